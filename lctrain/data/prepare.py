"""Data preparation, once per machine and visibly: records → samples → token stream → rows.

    rows = prepare_data(cfg.data, tokenizer, leader=local_rank == 0, show_progress=rank == 0)
    for line in rows_summary(rows): print(line)

The leader reads the source record by record (`lctrain.data.records`), turns records into
samples (`lctrain.data.formats`: the format, detected when ``data.format`` is auto, and the loss
mask), writes the token stream into the cache (`lctrain.data.cache`) and plans the rows
(`lctrain.data.packing`); with ``show_progress`` it shows how far it has got. Every other
process of the machine waits for the cache and memory-maps it; so does every later run with the
same source files, tokenizer and settings, which then starts at once. The function takes a
`DataConfig`, so any set of rows (an evaluation set from another source, say) is prepared the
same way.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from lctrain.config import DataConfig
from lctrain.data import cache
from lctrain.data.formats import Encoder, Skips, detect_format
from lctrain.data.packing import PackedRows, RowPlan, TokenStream, plan_rows
from lctrain.data.records import Record, RecordReader, source_identity
from lctrain.data.split import part_samples
from lctrain.data.tokenizer import ByteTokenizer, pad_token_id
from lctrain.errors import DataError

_BATCH = 512
PROGRESS_EVERY_S = 10.0
"""Seconds between the progress lines of a preparation whose output is not a terminal."""
"""Records tokenized together (fast tokenizers encode a batch in parallel)."""


def prepare_data(data: DataConfig, tokenizer: Any, *, leader: bool = True,
                 show_progress: bool = False, part: str = "train",
                 source_key: str = "data.source") -> PackedRows:
    """The packed rows of ``data``, from the cache or prepared into it.

    Args:
        data: the data settings (source, format, seq_len, long_samples, cache_dir, ...).
        tokenizer: from `load_tokenizer`.
        leader: this process builds what the cache lacks; the others wait for it. Exactly one
            process per machine (and cache folder) should be the leader.
        show_progress: print what is being prepared and how far it has got (rank 0).
        part: ``train`` — data.source without the documents data.eval_fraction holds out (all
            of it when that is 0); ``eval`` — the validation rows: data.eval_source prepared
            with the same settings, or the held-out documents (`lctrain.data.split`).
        source_key: the recipe key ``data.source`` holds the value of, named in messages about
            the source (``data.eval_source`` when preparing that one).

    Returns:
        PackedRows whose ``info`` says what was found (see `rows_summary`).

    Raises:
        DataError: unreadable source, bad record, no token to train on, unwritable cache, no
            validation data for ``eval``, or an eval_fraction that holds out none or all.
    """
    if part == "eval" and data.eval_source is not None:
        own = dataclasses.replace(data, source=data.eval_source, eval_source=None,
                                  max_documents=None)
        rows = prepare_data(own, tokenizer, leader=leader, show_progress=show_progress,
                            source_key="data.eval_source")
        rows.info["part"] = "eval"
        return rows
    if part == "eval" and data.eval_fraction == 0:
        raise DataError("there is no validation data; set data.eval_source (a file) or "
                        "data.eval_fraction (a share of data.source's documents)")
    root = Path(data.cache_dir).expanduser() if data.cache_dir else cache.default_cache_dir()
    folder = root / cache.digest(["tokens", source_identity(data), tokenizer_identity(tokenizer),
                                  data.format, data.text_field, data.max_documents])
    built = {"tokens": False, "rows": False}
    start = time.perf_counter()
    if leader:
        with cache.exclusive(folder.with_name(folder.name + ".lock")):
            if not (folder / "meta.json").exists():
                cache.build_folder(folder, lambda tmp: _write_tokens(tmp, data, tokenizer,
                                                                     show_progress, source_key))
                built["tokens"] = True
            meta = _meta(folder)
            samples = part_samples(data, part, meta["samples"])
            rows_file = _rows_file(folder, data, meta, part if samples is not None else None)
            if not rows_file.exists():
                stream = _open_stream(folder, meta)
                cache.write_file(rows_file, lambda tmp: _save_plan(
                    tmp, plan_rows(stream, data.seq_len, _mode(data, meta), samples)))
                built["rows"] = True
    else:
        cache.wait_for(folder / "meta.json")
        meta = _meta(folder)
        samples = part_samples(data, part, meta["samples"])
        rows_file = _rows_file(folder, data, meta, part if samples is not None else None)
        cache.wait_for(rows_file)
    stream = _open_stream(folder, meta)
    info = {**meta, "cache": str(folder), "built_tokens": built["tokens"],
            "built_rows": built["rows"], "seconds": time.perf_counter() - start,
            "long_samples": _mode(data, meta), "source": data.source, "part": part,
            **_part_counts(stream, data, part, samples)}
    return PackedRows(stream, _load_plan(rows_file), seq_len=data.seq_len,
                      document_mask=data.document_mask, pad_id=pad_token_id(tokenizer), info=info)


def _part_counts(stream: TokenStream, data: DataConfig, part: str,
                 samples: np.ndarray | None) -> dict:
    """What a part of the source holds: its documents, tokens and target tokens, and how many
    documents were held out (nothing when the part is the whole source)."""
    if samples is None:
        return {}
    held = samples if part == "eval" else np.setdiff1d(np.arange(stream.bounds.size - 1), samples)
    tokens = sum(int(stream.bounds[i + 1] - stream.bounds[i]) for i in held)
    targets = sum(int(stream.targets[stream.bounds[i]:stream.bounds[i + 1]].sum()) for i in held)
    total_tokens, total_targets = stream.total, int(np.count_nonzero(stream.targets))
    if part == "train":
        tokens, targets = total_tokens - tokens, total_targets - targets
    longest = int(np.diff(stream.bounds)[samples].max())
    return {"part_samples": int(samples.size), "part_tokens": tokens, "part_targets": targets,
            "part_longest": longest,
            "held_out": int(held.size), "eval_fraction": data.eval_fraction,
            "eval_seed": data.eval_seed}


def tokenizer_identity(tokenizer: Any) -> list:
    """What identifies how ``tokenizer`` turns text into ids: its class, full definition (the
    tokenizer.json of fast tokenizers, else the vocabulary), chat template, special ids and the
    ids of a probe text with special tokens (which catches bos/eos settings)."""
    probe = "lctrain probe"
    if isinstance(tokenizer, ByteTokenizer):
        return ["bytes", tokenizer.vocab_size, tokenizer.encode(probe)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(
        sorted(tokenizer.get_vocab().items()))
    return [type(tokenizer).__name__, cache.digest(definition), tokenizer.chat_template,
            len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
            tokenizer.pad_token_id, list(tokenizer(probe, add_special_tokens=True)["input_ids"])]


def _mode(data: DataConfig, meta: dict) -> str:
    """``data.long_samples`` with auto resolved: split for unmasked samples, else drop."""
    if data.long_samples != "auto":
        return data.long_samples
    masked = meta["format"] in ("prompt_completion", "chat") or meta["has_labels"]
    return "drop" if masked else "split"


def _rows_file(folder: Path, data: DataConfig, meta: dict, part: str | None) -> Path:
    """The row plan's file: one per seq_len and packing mode, and per part of the source when
    documents are held out (part None: the whole source, as always)."""
    key = ["rows", data.seq_len, _mode(data, meta)]
    if part is not None:
        key += [part, data.eval_fraction, data.eval_seed]
    return folder / f"rows-{cache.digest(key)}.npz"


def _meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def _open_stream(folder: Path, meta: dict) -> TokenStream:
    n = meta["tokens"]
    return TokenStream(np.memmap(folder / "ids.bin", dtype=np.int32, mode="r", shape=(n,)),
                       np.memmap(folder / "targets.bin", dtype=np.uint8, mode="r", shape=(n,)),
                       np.load(folder / "bounds.npy"))


def _save_plan(path: Path, plan: RowPlan) -> None:
    with open(path, "wb") as handle:
        np.savez(handle, starts=plan.starts, stops=plan.stops, offsets=plan.offsets,
                 counts=np.array([plan.long, plan.left_out, plan.first_long]))


def _load_plan(path: Path) -> RowPlan:
    with np.load(path) as z:
        long, left_out, first_long = (int(x) for x in z["counts"])
        return RowPlan(z["starts"], z["stops"], z["offsets"], long, left_out, first_long)


def _write_tokens(folder: Path, data: DataConfig, tokenizer: Any, show: bool,
                  source_key: str) -> None:
    """Read, encode and write the token stream of ``data`` into ``folder`` (meta.json last);
    ``source_key`` names the recipe key of ``data.source`` in messages."""
    reader = RecordReader(data, source_key=source_key)
    progress = _Progress(reader, data.source, show)
    records = iter(reader)
    first = list(islice(records, _BATCH))
    if not first:
        raise DataError(f"{source_key} {data.source!r} holds no record; point it at some data")
    fmt, why = (data.format, "data.format") if data.format != "auto" else detect_format(
        first[0], data.text_field)
    encoder = Encoder(fmt, tokenizer, data.text_field)
    counts = {"records": 0, "tokens": 0, "target_tokens": 0}
    lengths: list[int] = []
    with open(folder / "ids.bin", "wb") as ids, open(folder / "targets.bin", "wb") as flags, \
            open(folder / "wheres.txt", "w", encoding="utf-8") as wheres:
        for batch in _batches(first, records):
            counts["records"] += len(batch)
            for sample in encoder.encode(batch):
                sample.ids.tofile(ids)
                sample.targets.astype(np.uint8).tofile(flags)
                wheres.write(sample.where.replace("\n", " ") + "\n")
                lengths.append(sample.ids.size)
                counts["target_tokens"] += int(sample.targets.sum())
            counts["tokens"] = int(sum(lengths))
            progress.update(counts)
    progress.close(counts)
    if not lengths:
        skipped = encoder.skips.describe()
        raise DataError(f"data.source {data.source!r} yields no token to train on"
                        f"{': ' + skipped if skipped else ''}; check the records")
    np.save(folder / "bounds.npy", np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    meta = {"format": fmt, "format_reason": why, "has_labels": encoder.has_labels,
            "samples": len(lengths), "skipped": encoder.skips.reasons,
            "longest": int(max(lengths)), **counts}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))


def _batches(first: list[Record], rest: Iterator[Record]) -> Iterator[list[Record]]:
    yield first
    while batch := list(islice(rest, _BATCH)):
        yield batch


class _Progress:
    """What the leader shows while preparing: a rich bar on a terminal, else a line every
    `PROGRESS_EVERY_S` seconds; nothing when not shown."""

    def __init__(self, reader: RecordReader, source: str, show: bool) -> None:
        self.reader, self.show, self.every_s = reader, show, PROGRESS_EVERY_S
        self.start = self.last = time.perf_counter()
        self.bar = None
        if not show:
            return
        print(f"preparing data from {source} (tokenizing and packing once; later runs and the "
              f"other ranks of this machine reuse it)", flush=True)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]data"), BarColumn(),
                                TextColumn("{task.percentage:>3.0f}%  {task.fields[info]}"),
                                TimeRemainingColumn(), transient=True)
            self.task = self.bar.add_task("data", total=reader.total or None, info="")
            self.bar.start()

    def update(self, counts: dict) -> None:
        if not self.show:
            return
        info = f"{counts['records']:,} records, {counts['tokens']:,} tokens"
        if self.bar is not None:
            self.bar.update(self.task, completed=self.reader.done, total=self.reader.total or None,
                            info=info)
        elif time.perf_counter() - self.last >= self.every_s:
            self.last = time.perf_counter()
            done, total = self.reader.done, self.reader.total
            share = f"{100 * done / total:.0f} % read, " if total else ""
            print(f"preparing data: {share}{info}", flush=True)

    def close(self, counts: dict) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.show:
            print(f"prepared {counts['records']:,} records into {counts['tokens']:,} tokens in "
                  f"{time.perf_counter() - self.start:.1f} s", flush=True)


def rows_summary(rows: PackedRows) -> list[str]:
    """Lines for the run's banner: the data's format (and how it was found), samples, tokens,
    targets, skipped records, long samples, rows, padding, and the cache."""
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
                     f"documents (data.eval_fraction {info['eval_fraction']:g}, data.eval_seed "
                     f"{info['eval_seed']}), never trained on")
    real = int((plan.stops - plan.starts).sum())
    lines.append(f"rows: {len(rows):,} × {seq_len:,} tokens, {_mode_text(info['long_samples'])}, "
                 f"{100 * (1 - real / (len(rows) * seq_len)):.1f} % padding")
    if plan.long:
        lines.append(_long_text(rows))
    how = "prepared" if info["built_tokens"] else "reused" if not info["built_rows"] else \
        "tokens reused, rows planned"
    lines.append(f"cache: {info['cache']} ({how}, {info['seconds']:.1f} s)")
    return lines


def _mode_text(mode: str) -> str:
    return "samples end to end, cut every row" if mode == "split" else \
        f"whole samples best-fit (longer ones: {mode.replace('_', ' ')})"


def _long_text(rows: PackedRows) -> str:
    plan, info = rows.plan, rows.info
    where = _where(Path(info["cache"]), plan.first_long)
    what = {"split": "continue in the next row", "drop": "were left out",
            "truncate_left": f"keep their last {rows.seq_len:,} tokens",
            "truncate_right": f"keep their first {rows.seq_len:,} tokens"}[info["long_samples"]]
    extra = (f" ({plan.left_out:,} kept no target token and were left out)"
             if plan.left_out and info["long_samples"] != "drop" else "")
    return (f"long samples: {plan.long:,} longer than {rows.seq_len:,} tokens {what}{extra} "
            f"(longest {info.get('part_longest', info['longest']):,}; first at {where}; "
            f"data.long_samples)")


def _where(folder: Path, index: int) -> str:
    with open(folder / "wheres.txt", encoding="utf-8") as handle:
        line = next(islice(handle, index, None), "?")
    return line.rstrip("\n")

