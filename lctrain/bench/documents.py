"""Packed-document mixes for the benchmarks: ``--documents SPEC`` as the documents of a row.

    8                        8 documents of (nearly) equal length
    8x8k                     8 documents of 8K (sizes as for --seq-len); they must fill the row
    20k,12k,3x2k,rest        listed lengths in order; ``rest`` takes whatever is left
    lognormal:mean=12k       log-normal lengths until the row is full (``median=`` may replace
      [,sigma=1.0][,seed=0]  ``mean=``)
    lengths:PATH[@ROW]       a file of lengths laid end to end and cut into rows; row ROW
    data:PATH[@ROW]          a data file tokenized with the recipe's tokenizer, cut likewise

Rates count the attention inside each document only (`lctrain.model.flops`).
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path

from lctrain.config import ConfigError, RecipeConfig, format_tokens, parse_size


@dataclass(frozen=True)
class Documents:
    """Document lengths of one packed row (summing to the row's length) and their spec."""

    lengths: tuple[int, ...]
    spec: str

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def pairs(self) -> int:
        """Σ n² over the documents: what their masked attention costs, up to a constant."""
        return sum(n * n for n in self.lengths)

    @property
    def cu_seqlens(self) -> tuple[int, ...]:
        """Document bounds ``(0, L0, L0 + L1, ..., total)``, as the attention takes them."""
        return (0, *accumulate(self.lengths))

    def summary(self) -> str:
        """One line such as ``10 documents of 1k..20k tokens, median 5k``."""
        ordered = sorted(self.lengths)
        mid = ordered[len(ordered) // 2]
        count = f"{len(ordered)} document{'s' * (len(ordered) != 1)} of "
        if ordered[0] == ordered[-1]:
            return f"{count}{format_tokens(mid)} tokens"
        return (f"{count}{format_tokens(ordered[0])}..{format_tokens(ordered[-1])} tokens, "
                f"median {format_tokens(mid)}")

    @staticmethod
    def summary_of(rows: list[Documents]) -> str:
        """:meth:`summary` of one row, or of several different ones pooled, such as ``3 rows of
        5..8 documents of 2k..52k tokens, median 16k``."""
        if len(set(rows)) == 1:
            return rows[0].summary()
        few, many = min(len(r.lengths) for r in rows), max(len(r.lengths) for r in rows)
        pooled = Documents(tuple(n for r in rows for n in r.lengths), rows[0].spec).summary()
        return f"{len(rows)} rows of {few}{f'..{many}' * (many != few)} {pooled.split(' ', 1)[1]}"

    def scaled(self, total: int) -> Documents:
        """The same mix over ``total`` tokens (at most `total`): every bound scaled and rounded;
        a document that shrinks to nothing joins the next one."""
        if total == self.total:
            return self
        bounds = [round(b * total / self.total) for b in self.cu_seqlens]
        kept = [b for a, b in zip(bounds, bounds[1:]) if b > a]
        lengths = [b - a for a, b in zip([0] + kept, kept)]
        return Documents(tuple(lengths), f"{self.spec} scaled to {total}")


def parse_documents(spec: str, total: int, *, recipe: RecipeConfig | None = None) -> Documents:
    """The documents of a row of ``total`` tokens described by ``spec`` (module docstring);
    ``recipe`` (its tokenizer) reads a ``data:`` spec. ConfigError for a bad spec, a missing
    file or recipe; DataError for a ``data:`` file that cannot be read."""
    return parse_each(spec, [total], recipe=recipe)[total]


def parse_each(spec: str | int, totals, *, recipe: RecipeConfig | None = None
               ) -> dict[int, Documents]:
    """`parse_documents` for each of ``totals`` (a file is read once): {total: Documents}.
    ``spec`` may be an int N (N equal documents)."""
    text = str(spec).strip()
    if min(totals, default=1) < 1:
        raise ConfigError(f"--documents needs a positive sequence length, got {min(totals)}")
    kind, _, rest = text.partition(":")
    if kind == "lognormal":
        make = lambda total: _lognormal(rest, total, text)  # noqa: E731
    elif kind in ("lengths", "data"):
        path, row = _path_and_row(rest, text)
        stream = _file_lengths(path, text) if kind == "lengths" else \
            _data_lengths(path, recipe, text)
        make = lambda total: _cut(stream, total, row, text)  # noqa: E731
    elif text.isdigit():
        make = lambda total: _equal(int(text), total)  # noqa: E731
    else:
        make = lambda total: _listed(text, total)  # noqa: E731
    return {total: Documents(tuple(make(total)), text) for total in totals}


def _equal(count: int, total: int) -> list[int]:
    """``count`` documents of (nearly) equal length filling ``total``."""
    if not 1 <= count <= total:
        raise ConfigError(f"--documents {count} asks for {count} documents but a sequence of "
                          f"{total} tokens holds 1 to {total}; give a count in that range, or "
                          f"lengths such as 8x8k")
    bounds = [round(i * total / count) for i in range(count + 1)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _listed(text: str, total: int) -> list[int]:
    """``8x8k`` / ``20k,12k,3x2k,rest``: listed lengths that must fill ``total``."""
    items = [item.strip() for item in text.split(",")]
    rest = bool(items) and items[-1] == "rest"
    lengths = []
    for item in items[:-1] if rest else items:
        count, times, size = item.rpartition("x")
        if not size or (times and not (count.isdigit() and int(count) > 0)):
            raise ConfigError(f"--documents item {item!r} of {text!r} is not a length; write "
                              f"sizes such as 8k or 3x2k (N documents of L tokens), comma "
                              f"separated, or lognormal:mean=12k, lengths:FILE, data:FILE")
        lengths += [parse_size(size, what="--documents length")] * int(count or 1)
    used = sum(lengths)
    if used > total or (used < total and not rest):
        fix = "end the list with ,rest for one more document" if used < total else "shorten it"
        raise ConfigError(f"--documents {text!r} holds {used} tokens but the sequence holds "
                          f"{total}; make the lengths add up to {total} or {fix}")
    return lengths + ([total - used] if used < total else [])


def _lognormal(text: str, total: int, spec: str, draw: int = 0) -> list[int]:
    """Log-normal lengths (mean or median, sigma, seed) drawn until ``total`` is full, with the
    seed ``draw`` further on."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in ("mean", "median", "sigma", "seed") or key in options:
            raise ConfigError(f"--documents {spec!r}: {item!r} is not one of mean, median, seed, "
                              f"sigma given once as key=value")
        options[key] = value.strip()
    if ("mean" in options) == ("median" in options):
        raise ConfigError(f"--documents {spec!r} needs exactly one of mean= or median=, such as "
                          f"lognormal:mean=12k")
    try:
        sigma, seed = float(options.get("sigma", "1.0")), int(options.get("seed", "0"))
    except ValueError:
        raise ConfigError(f"--documents {spec!r}: sigma must be a number and seed a whole "
                          f"number, such as lognormal:mean=12k,sigma=0.8,seed=1") from None
    if not 0.0 < sigma <= 4.0:
        raise ConfigError(f"--documents {spec!r}: sigma is {sigma} but must be in (0, 4]")
    center = parse_size(options.get("mean") or options["median"], what=f"--documents {spec!r}")
    mu = math.log(center) - (sigma * sigma / 2 if "mean" in options else 0.0)
    rng, lengths, used = random.Random(seed + draw), [], 0
    while used < total:
        n = min(max(1, round(rng.lognormvariate(mu, sigma))), total - used)
        lengths.append(n)
        used += n
    return lengths


def _path_and_row(text: str, spec: str) -> tuple[Path, int]:
    match = re.fullmatch(r"(.+?)(?:@(\d+))?", text.strip())
    if match is None:  # nothing after the colon
        raise ConfigError(f"--documents {spec!r} names no file; write lengths:FILE or data:FILE, "
                          f"optionally @ROW")
    path = Path(match.group(1)).expanduser()
    if not path.is_file():
        raise ConfigError(f"--documents {spec!r}: no file {str(path)!r}; check the path")
    return path, int(match.group(2) or 0)


def _file_lengths(path: Path, spec: str) -> list[int]:
    """Whole positive numbers of a text file (whitespace or commas between them)."""
    words = path.read_text().replace(",", " ").split()
    bad = next((w for w in words if not (w.isdigit() and int(w) > 0)), None if words else "nothing")
    if bad is not None:
        raise ConfigError(f"--documents {spec!r}: the file must hold positive whole numbers "
                          f"(document lengths), found {bad!r}")
    return [int(w) for w in words]


def _data_lengths(path: Path, recipe, spec: str) -> list[int]:
    """Token counts (with eos) of every document of a data file, tokenized as training does."""
    if recipe is None:
        raise ConfigError(f"--documents {spec!r} tokenizes the file with a recipe's tokenizer; "
                          f"add --recipe RECIPE, or give lengths:FILE instead")
    from lctrain.data import Encoder, RecordReader
    from lctrain.model import load_tokenizer

    data = replace(recipe.data, source=str(path))
    records = list(RecordReader(data))
    if not records:
        raise ConfigError(f"--documents {spec!r}: {path} holds no record")
    encoder = Encoder.for_data(data, load_tokenizer(replace(recipe, data=data)), records[0])
    return [int(sample.ids.size) for sample in encoder.encode(records) if sample.ids.size]


def _cut(stream: list[int], total: int, row: int, spec: str) -> list[int]:
    """Lengths of the documents within ``[row·total, (row+1)·total)`` of a stream of them."""
    lo, hi = row * total, (row + 1) * total
    if sum(stream) < hi:
        raise ConfigError(f"--documents {spec!r} holds {sum(stream)} tokens, fewer than the "
                          f"{hi} that row {row} of {total} tokens needs; pick a smaller row or "
                          f"sequence length")
    inner = [end for end in accumulate(stream) if lo < end < hi]  # document ends inside the row
    return [b - a for a, b in zip([lo, *inner], [*inner, hi])]


def training_rows(spec: str, total: int, count: int) -> list[Documents]:
    """``count`` rows of ``total`` tokens to train on (``lctrain bench step --documents``); a
    ``lognormal:`` spec draws each row with the next seed, a fixed mix repeats."""
    head = spec.strip().split(":", 1)[0].strip().lower()
    if head in ("lengths", "data"):
        raise ConfigError(f"--documents {spec!r}: bench step packs rows from a mix, not from a "
                          f"file; to train on a file's rows use --set data.source=FILE")
    if head != "lognormal":
        return [parse_documents(spec, total)] * count
    return [Documents(tuple(_lognormal(spec.split(":", 1)[1], total, spec, k)), spec)
            for k in range(count)]


def attended_share(spec: str | None, total: int, *, recipe: RecipeConfig | None = None,
                   count: int = 64) -> float:
    """The mean Σ n² / total² of ``count`` drawn rows of a ``lognormal:`` mix, else of ``spec``'s
    one row: the share of a one-document row's pairs that they attend (None: 1.0)."""
    if spec is None:
        return 1.0
    if recipe is not None and not recipe.data.document_mask:
        raise ConfigError(f"--documents {spec!r} times documents masked apart, but the recipe's "
                          f"data.document_mask is false; add --set data.document_mask=true")
    rows = (training_rows(spec, total, count) if spec.strip().lower().startswith("lognormal")
            else [parse_documents(spec, total, recipe=recipe)])
    return sum(row.pairs for row in rows) / len(rows) / total ** 2
