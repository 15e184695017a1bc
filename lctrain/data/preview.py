"""``lctrain data preview``: the first packed rows as training takes them, each document piece's
text with its trained tokens marked, and per row its tokens, labels, documents and padding."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lctrain.data.packing import IGNORE, PackedRows
from lctrain.data.prepare import sample_wheres

_CONTEXT = 8  # tokens decoded before a run, so that its first token reads as in the whole text


@dataclass(frozen=True)
class Piece:
    """Tokens ``start:stop`` of sample ``sample`` (``length`` tokens, read from ``where``) as
    (text, trained) runs."""

    sample: int
    where: str
    start: int
    stop: int
    length: int
    runs: list[tuple[str, bool]]


@dataclass(frozen=True)
class RowPreview:
    """Packed row ``index``: its document pieces; ``tokens`` without padding, ``trained`` the
    positions with a label (a loss term), ``documents`` the pieces of samples it holds."""

    index: int
    tokens: int
    trained: int
    documents: int
    padding: int
    pieces: list[Piece]


def preview_rows(rows: PackedRows, tokenizer: Any, count: int) -> list[RowPreview]:
    """The first ``count`` rows of ``rows``, in row order."""
    stream, bounds = rows.stream, rows.stream.bounds
    spans = [rows.pieces(r) for r in range(min(count, len(rows)))]  # (sample, start, stop)s
    wheres = sample_wheres(rows.info.get("cache"), {s for row in spans for s, _, _ in row})
    out = []
    for r, row in enumerate(spans):
        packed = rows.row(r)
        tokens = sum(b - a for _, a, b in row)
        pieces = [Piece(s, wheres.get(s, f"sample {s + 1}"), a - int(bounds[s]),
                        b - int(bounds[s]), int(bounds[s + 1] - bounds[s]),
                        marked_runs(tokenizer, stream.ids[a:b], stream.targets[a:b]))
                  for s, a, b in row]
        out.append(RowPreview(r, tokens, int((packed["labels"] != IGNORE).sum()), len(pieces),
                              rows.seq_len - tokens, pieces))
    return out


def marked_runs(tokenizer: Any, ids: Sequence[int], targets: Sequence[bool]
                ) -> list[tuple[str, bool]]:
    """The text of ``ids`` (at least one; special tokens shown) as runs of equal ``targets``."""
    ids, flags = [int(i) for i in ids], np.asarray(targets, dtype=bool)
    cuts = [0, *(np.flatnonzero(flags[1:] != flags[:-1]) + 1).tolist(), len(ids)]
    runs = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        context = max(0, a - _CONTEXT)
        before = tokenizer.decode(ids[context:a], skip_special_tokens=False) if a else ""
        whole = tokenizer.decode(ids[context:b], skip_special_tokens=False)
        runs.append((whole[len(before):] if whole.startswith(before) else
                     tokenizer.decode(ids[a:b], skip_special_tokens=False), bool(flags[a])))
    return runs


def bracketed(runs: Sequence[tuple[str, bool]]) -> str:
    """The runs as one text, trained ones in ``[[...]]``."""
    return "".join(f"[[{text}]]" if trained else text for text, trained in runs)


def heading(piece: Piece) -> str:
    """``"docs.jsonl:2"``, or with the tokens shown when the row holds part of the sample."""
    part = "" if piece.stop - piece.start == piece.length else \
        f" (tokens {piece.start:,}-{piece.stop - 1:,} of {piece.length:,})"
    return f"{here(piece.where)}{part}"


def here(text: str) -> str:
    """``text`` with the current folder's paths made relative."""
    return text.replace(os.path.join(os.getcwd(), ""), "")
