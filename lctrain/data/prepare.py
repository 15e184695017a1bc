"""Data preparation, once per machine and visibly: records → samples → token stream → rows.

The leader writes the encoded source into the cache (``$XDG_CACHE_HOME/lctrain/data``, else
``~/.cache/lctrain/data``: one folder per `digest` of all the content depends on, appearing by
atomic rename) and plans the rows; other processes and later runs memory-map it.
``data.eval_source`` as a share holds documents out of the training rows (drawn from
``train.seed``); both parts share the token stream."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from lctrain.config import DataConfig
from lctrain.data.formats import Encoder, Skips
from lctrain.data.packing import PackedRows, RowPlan, TokenStream, plan_rows
from lctrain.data.records import RecordReader, load_datasets, source_identity
from lctrain.data.tokenizer import ByteTokenizer, pad_token_id
from lctrain.errors import DataError

_BATCH = 512  # records tokenized together
RECORDS_PER_PROCESS = 2000  # the least a tokenizing process is started for
LAYOUT_VERSION = 3  # bumped whenever what a cache folder holds changes
ROWS_VERSION = 2  # bumped whenever a row plan (rows-*.npz) changes; the tokens stay


def held_out(documents: int, fraction: float, seed: int) -> np.ndarray:
    """Sorted int64 indices of the round(fraction × documents) held out (DataError: none or all)."""
    count = int(round(fraction * documents))
    if count < 1:
        raise DataError(f"data.eval_source {fraction:g} of {documents} documents holds out none; "
                        f"raise it to at least {1 / documents:.2g} or give a file")
    if count >= documents:
        raise DataError(f"data.eval_source {fraction:g} of {documents} documents holds out all "
                        f"of them and leaves none to train on; lower it or give a file")
    rng = np.random.default_rng([seed, documents])
    return np.sort(rng.choice(documents, size=count, replace=False)).astype(np.int64)


def part_samples(data: DataConfig, part: str, documents: int, seed: int = 0) -> np.ndarray | None:
    """The sample indices of ``part`` of the source's ``documents`` (None: all, none held out)."""
    if data.eval_fraction == 0:
        return None
    chosen = held_out(documents, data.eval_fraction, seed)
    return chosen if part == "eval" else np.setdiff1d(np.arange(documents, dtype=np.int64), chosen)


def prepare_data(data: DataConfig, tokenizer: Any, *, leader: bool = True,
                 show_progress: bool = False, part: str = "train",
                 source_key: str = "data.source", seed: int = 0) -> PackedRows:
    """The packed rows of ``part`` of ``data`` (``train``: without the documents ``seed`` holds
    out; ``eval``: data.eval_source or those), from the cache or prepared into it by the
    ``leader`` (one per machine; the others wait). ``source_key`` is named in messages."""
    if part == "eval" and isinstance(data.eval_source, str):
        own = dataclasses.replace(data, source=data.eval_source, eval_source=None,
                                  max_documents=None)
        rows = prepare_data(own, tokenizer, leader=leader, show_progress=show_progress,
                            source_key="data.eval_source")
        rows.info["part"] = "eval"
        return rows
    if part == "eval" and data.eval_fraction == 0:
        raise DataError("there is no validation data; set data.eval_source (a file, or a share "
                        "of data.source's documents such as 0.05)")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(cache, "lctrain", "data", digest([
        "tokens", source_identity(data), tokenizer_identity(tokenizer), data.format,
        data.text_field, data.max_documents, data.fields, data.chat_template, data.turns]))
    built_tokens = built_rows = False
    start = time.perf_counter()
    with exclusive(folder.with_name(folder.name + ".lock")) if leader else contextlib.nullcontext():
        if leader and not (folder / "meta.json").exists():
            build_folder(folder, lambda tmp: _write_tokens(tmp, data, tokenizer, show_progress,
                                                           source_key, folder.name))
            built_tokens = True
        wait_for(folder / "meta.json")
        meta = json.loads((folder / "meta.json").read_text())
        samples, mode = part_samples(data, part, meta["samples"], seed), _mode(data, meta)
        key = ["rows", ROWS_VERSION, data.seq_len, mode]  # the row plan's, per part
        if samples is not None:
            key += [part, data.eval_fraction, seed]
        rows_file = folder / f"rows-{digest(key)}.npz"
        shape = (meta["tokens"],)
        stream = TokenStream(np.memmap(folder / "ids.bin", np.int32, "r", shape=shape),
                             np.memmap(folder / "targets.bin", np.uint8, "r", shape=shape),
                             np.load(folder / "bounds.npy"))
        if leader and not rows_file.exists():
            _save_plan(rows_file, plan_rows(stream, data.seq_len, mode, samples))
            built_rows = True
        wait_for(rows_file)
    info = {**meta, "cache": str(folder), "built_tokens": built_tokens, "built_rows": built_rows,
            "seconds": time.perf_counter() - start, "long_samples": mode,
            "source": data.source, "part": part, **_part_counts(stream, data, part, samples, seed)}
    with np.load(rows_file) as z:
        plan = RowPlan(z["starts"], z["stops"], z["offsets"], *(int(x) for x in z["counts"]))
    return PackedRows(stream, plan, seq_len=data.seq_len, document_mask=data.document_mask,
                      pad_id=pad_token_id(tokenizer), info=info)


def _part_counts(stream: TokenStream, data: DataConfig, part: str,
                 samples: np.ndarray | None, seed: int) -> dict:
    """A part's documents, tokens, targets and held-out count ({} for the whole source)."""
    if samples is None:
        return {}
    lengths = np.diff(stream.bounds)[samples]
    # per sample; reduceat needs no sample to be empty, and each holds a target token
    targets = np.add.reduceat(stream.targets, stream.bounds[:-1], dtype=np.int64)[samples]
    held = samples.size if part == "eval" else stream.bounds.size - 1 - samples.size
    return {"part_samples": int(samples.size), "part_tokens": int(lengths.sum()),
            "part_targets": int(targets.sum()), "part_longest": int(lengths.max()),
            "held_out": held, "eval_fraction": data.eval_fraction, "seed": seed}


def tokenizer_identity(tokenizer: Any) -> list:
    """What identifies how ``tokenizer`` turns text into ids (for the cache key)."""
    probe = "lctrain probe"
    if isinstance(tokenizer, ByteTokenizer):
        return ["bytes", tokenizer.vocab_size, tokenizer.encode(probe), tokenizer.chat_template]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(
        sorted(tokenizer.get_vocab().items()))
    return [type(tokenizer).__name__, digest(definition), tokenizer.chat_template,
            len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
            tokenizer.pad_token_id, list(tokenizer(probe, add_special_tokens=True)["input_ids"])]


def _mode(data: DataConfig, meta: dict) -> str:
    """``data.long_samples`` with auto resolved: split for unmasked samples, else drop."""
    if data.long_samples != "auto":
        return data.long_samples
    masked = meta["format"] in ("prompt_completion", "chat") or meta["has_labels"]
    return "drop" if masked else "split"


def _save_plan(path: Path, plan: RowPlan) -> None:
    """Write ``plan`` to ``path`` atomically (a temporary file renamed)."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        np.savez(tmp, starts=plan.starts, stops=plan.stops, offsets=plan.offsets,
                 counts=np.array([plan.long, plan.left_out, plan.first_long]))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_tokens(folder: Path, data: DataConfig, tokenizer: Any, show: bool,
                  source_key: str, fingerprint: str) -> None:
    """Read and encode ``data`` with a batched ``Dataset.map`` (its result cached by datasets
    under ``fingerprint``), then write its token stream into ``folder`` (meta.json last)."""
    start = time.perf_counter()
    bars = load_datasets().utils.logging  # datasets' progress bars: on while preparing visibly
    if show:
        print(f"preparing data from {data.source} (tokenizing and packing once; later runs and "
              f"the other ranks of this machine reuse it)", flush=True)
        bars.enable_progress_bar()
    try:
        reader = RecordReader(data, source_key=source_key)
        if not len(reader):
            raise DataError(f"{source_key} {data.source!r} holds no record; point it at some data")
        encoder = Encoder.for_data(data, tokenizer, next(iter(reader)))
        processes = min(len(os.sched_getaffinity(0)), len(reader) // RECORDS_PER_PROCESS)
        encoded = reader.dataset.map(
            _encode, batched=True, batch_size=_BATCH, with_indices=True,
            num_proc=processes if processes > 1 else None, features=_features(),
            remove_columns=reader.dataset.column_names,
            fn_kwargs={"reader": reader, "encoder": encoder}, new_fingerprint=fingerprint,
            desc="tokenizing")
    finally:
        bars.disable_progress_bar()
    lengths, target_tokens, skips, has_labels = [], 0, Skips(), False
    with open(folder / "ids.bin", "wb") as ids, open(folder / "targets.bin", "wb") as flags, \
            open(folder / "wheres.txt", "w", encoding="utf-8") as wheres:
        for batch in encoded.with_format("arrow").iter(batch_size=1 << 16):
            column = batch.column("ids").combine_chunks()
            column.flatten().to_numpy().astype(np.int32).tofile(ids)
            targets = batch.column("targets").combine_chunks().flatten().to_numpy(False)
            targets.astype(np.uint8).tofile(flags)
            target_tokens += int(targets.sum())
            reasons = batch.column("skip").to_pylist()  # "" for a sample
            lengths.extend(column.value_lengths().to_numpy()[np.asarray(reasons) == ""].tolist())
            for where, skip, count in zip(batch.column("where").to_pylist(), reasons,
                                          batch.column("count").to_pylist()):
                if skip:
                    skips.add(skip, where, count)
                else:
                    wheres.write(where.replace("\n", " ") + "\n")
            has_labels |= any(batch.column("labels").to_pylist())
    tokens = int(sum(lengths))  # skip rows hold no token
    if show:
        print(f"prepared {len(reader):,} records into {tokens:,} tokens in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    if not lengths:
        raise no_tokens(data.source, skips, source_key)
    np.save(folder / "bounds.npy", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    meta = {"format": encoder.fmt, "format_reason": encoder.why, "has_labels": has_labels,
            "samples": len(lengths), "skipped": skips.reasons, "processes": max(processes, 1),
            "longest": int(max(lengths)), "records": len(reader), "tokens": tokens,
            "target_tokens": target_tokens}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def _features():
    from datasets import Features, Sequence, Value

    return Features({"ids": Sequence(Value("int32")), "targets": Sequence(Value("bool")),
                     "where": Value("string"), "skip": Value("string"), "count": Value("int64"),
                     "labels": Value("bool")})


def _encode(batch: dict[str, list], rows: list[int], reader: RecordReader,
            encoder: Encoder) -> dict[str, list]:
    """A batch of records as samples, then a row per skip reason (its count and first place);
    ``labels``: whether tokenized records carried labels."""
    encoder.skips, encoder.has_labels = Skips(), False
    samples = encoder.encode(reader.records(batch, rows))
    skipped = list(encoder.skips.reasons.items())
    none = [np.zeros(0, np.int32)] * len(skipped)
    return {"ids": [s.ids for s in samples] + none,
            "targets": [s.targets for s in samples] + [n.astype(bool) for n in none],
            "where": [s.where for s in samples] + [where for _, (_, where) in skipped],
            "skip": [""] * len(samples) + [reason for reason, _ in skipped],
            "count": [1] * len(samples) + [count for _, (count, _) in skipped],
            "labels": [encoder.has_labels] * (len(samples) + len(skipped))}


def rows_summary(rows: PackedRows) -> list[str]:
    """The banner's lines about the data: format, counts, skips, long samples, rows, cache."""
    info, plan, seq_len = rows.info, rows.plan, rows.seq_len
    samples = info.get("part_samples", info["samples"])
    tokens = info.get("part_tokens", info["tokens"])
    targets = info.get("part_targets", info["target_tokens"])
    skipped = Skips(info["skipped"]).describe()
    what = "validation data" if info.get("part") == "eval" else "data"
    lines = [f"{what}: {info['source']}, format {info['format']} ({info['format_reason']}); "
             f"{samples:,} samples, {tokens:,} tokens, {targets:,} "
             f"{'scored' if what != 'data' else 'trained on'} "
             f"({100 * targets / max(tokens, 1):.0f} %)" + (f"; {skipped}" if skipped else "")]
    if "held_out" in info:
        lines.append(f"held out for validation: {info['held_out']:,} of {info['samples']:,} "
                     f"documents (data.eval_source {info['eval_fraction']:g}, train.seed "
                     f"{info['seed']}), never trained on")
    real, mode = int((plan.stops - plan.starts).sum()), info["long_samples"]
    packing = "samples end to end, cut every row" if mode == "split" else \
        f"whole samples best-fit (longer ones: {mode.replace('_', ' ')})"
    lines.append(f"rows: {len(rows):,} × {seq_len:,} tokens, {packing}, "
                 f"{100 * (1 - real / (len(rows) * seq_len)):.1f} % padding")
    if plan.long:
        where = sample_wheres(info["cache"], {plan.first_long}).get(plan.first_long, "?")
        what = {"split": "continue in the next row", "drop": "were left out",
                "truncate_left": f"keep their last {seq_len:,} tokens",
                "truncate_right": f"keep their first {seq_len:,} tokens"}[mode]
        extra = (f" ({plan.left_out:,} kept no target token and were left out)"
                 if plan.left_out and mode != "drop" else "")
        lines.append(f"long samples: {plan.long:,} longer than {seq_len:,} tokens {what}{extra} "
                     f"(longest {info.get('part_longest', info['longest']):,}; first at {where}; "
                     f"data.long_samples)")
    how = "prepared" if info["built_tokens"] else "reused" if not info["built_rows"] else \
        "tokens reused, rows planned"
    lines.append(f"cache: {info['cache']} ({how}, {info['seconds']:.1f} s)")
    return lines


def sample_wheres(cache: str | None, samples: set[int]) -> dict[int, str]:
    """Where each of ``samples`` came from (the cache's wheres.txt; {} without one)."""
    if cache is None or not samples:
        return {}
    with open(Path(cache) / "wheres.txt", encoding="utf-8") as handle:
        return {i: line.rstrip("\n") for i, line in enumerate(islice(handle, max(samples) + 1))
                if i in samples}


def digest(parts: Any) -> str:
    """A short hex hash of JSON-serialisable ``parts`` (with the layout version)."""
    text = json.dumps([LAYOUT_VERSION, parts], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` inside the block (DataError: unwritable)."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a+")
    except OSError as error:
        raise DataError(f"cannot write the data cache in {lock_path.parent} ({error.strerror}); "
                        f"set XDG_CACHE_HOME to a writable folder") from None
    with handle:  # closing the file releases the lock
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def build_folder(folder: Path, build: Callable[[Path], None]) -> None:
    """Run ``build(tmp)`` into a fresh temporary folder, then rename it to ``folder`` (a stale
    one without ``meta.json`` is replaced)."""
    if folder.exists() and not (folder / "meta.json").exists():
        shutil.rmtree(folder)
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def wait_for(path: Path) -> None:
    """Block until ``path`` exists (the leader is writing it)."""
    while not path.exists():
        time.sleep(0.2)


def no_tokens(source: str, skips: Skips, key: str = "data.source") -> DataError:
    """The error of a source (recipe ``key``) with nothing to train on; ``skips`` say why."""
    skipped = skips.describe()
    return DataError(f"{key} {source!r} yields no token to train on"
                     f"{': ' + skipped if skipped else ''}; check the records")
