"""Packing samples into rows of exactly ``seq_len`` tokens (labels shifted before any split) and
batching them: ``split`` cuts the stream every seq_len tokens, the other ``data.long_samples``
modes keep each sample whole in one row (best-fit decreasing). Each epoch is a permutation drawn
from ``(seed, epoch)``, so dp ranks see disjoint rows and a resume is exact."""
from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from lctrain.errors import DataError

IGNORE = -100  # the label of positions without loss


@dataclass(frozen=True)
class TokenStream:
    """All samples end to end: (T,) int32 ``ids``, (T,) bool/uint8 ``targets`` (may be
    memory maps) and (n + 1,) int64 sample ``bounds``."""

    ids: np.ndarray
    targets: np.ndarray
    bounds: np.ndarray


@dataclass(frozen=True)
class RowPlan:
    """The stream pieces of each row (row r is pieces ``offsets[r]:offsets[r+1]``), each within
    one sample, and the samples longer than a row: their count, those left out, the first one's
    index (or -1)."""

    starts: np.ndarray  # (pieces,) int64
    stops: np.ndarray  # (pieces,) int64
    offsets: np.ndarray  # (rows + 1,) int64
    long: int = 0
    left_out: int = 0
    first_long: int = -1

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)


def plan_rows(stream: TokenStream, seq_len: int, mode: str,
              samples: np.ndarray | None = None) -> RowPlan:
    """The pieces of every row of the sorted ``samples`` (None: all) for ``mode``
    (data.long_samples); DataError: no token, or every sample left out."""
    chosen = np.arange(stream.bounds.size - 1) if samples is None else np.asarray(samples, np.int64)
    lengths = np.diff(stream.bounds)[chosen]
    if int(lengths.sum()) == 0:
        raise DataError("the data yields no token to train on; check data.source and data.format")
    long_at = np.flatnonzero(lengths > seq_len)
    first = int(chosen[long_at[0]]) if long_at.size else -1
    if mode == "split":
        return RowPlan(*_split_pieces(stream.bounds, chosen, seq_len), long_at.size, 0, first)
    starts, stops = stream.bounds[chosen].copy(), stream.bounds[chosen + 1].copy()
    if mode == "truncate_left":
        starts[long_at] = stops[long_at] - seq_len
    elif mode == "truncate_right":
        stops[long_at] = starts[long_at] + seq_len
    keep = np.ones(chosen.size, bool)
    for s in long_at:  # dropped, or kept where its truncated part has a target
        keep[s] = mode != "drop" and bool(np.any(stream.targets[starts[s]:stops[s]]))
    kept = np.flatnonzero(keep)
    if kept.size == 0:
        raise DataError(f"every sample is longer than data.seq_len {seq_len} and data.long_samples "
                        f"is {mode}, which leaves nothing to train on; raise data.seq_len or use "
                        f"truncate_left / truncate_right")
    rows = _best_fit(stops[kept] - starts[kept], seq_len)
    order = np.lexsort((kept, rows))  # by row, then sample order
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rows))]).astype(np.int64)
    return RowPlan(starts[kept][order], stops[kept][order], offsets, long_at.size,
                   chosen.size - kept.size, first)


def _split_pieces(bounds: np.ndarray, chosen: np.ndarray,
                  seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, stops, offsets) of ``split`` rows over the chosen samples laid end to end."""
    lengths = bounds[chosen + 1] - bounds[chosen]
    joined = np.concatenate([[0], np.cumsum(lengths)])  # sample starts in the joined tokens
    total = int(joined[-1])
    cuts = np.union1d(joined, np.arange(0, total, seq_len, dtype=np.int64))
    cuts = cuts[cuts < total]  # (pieces,) joined start of each piece, none empty (unique)
    ends = np.append(cuts[1:], total)
    # which chosen sample holds it: the last of those starting there (the others are empty)
    sample = np.searchsorted(joined, cuts, side="right") - 1
    starts = bounds[chosen[sample]] + (cuts - joined[sample])
    offsets = np.concatenate([[0], np.cumsum(np.bincount(cuts // seq_len))]).astype(np.int64)
    return starts.astype(np.int64), (starts + ends - cuts).astype(np.int64), offsets


def _best_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Row number of each item under best-fit decreasing; rows numbered by their first item."""
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    row_of = np.empty(lengths.size, dtype=np.int64)
    n_rows = 0
    for i in np.argsort(-lengths, kind="stable"):
        need = int(lengths[i])
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row, n_rows = capacity, n_rows, n_rows + 1
        row_of[i] = row
        if room - need:
            bisect.insort(free, (room - need, row))
    _, first_item = np.unique(row_of, return_index=True)  # (rows,) each row's first item
    return np.argsort(np.argsort(first_item))[row_of]


class PackedRows:
    """The packed rows of a token stream (``len(rows)``, ``rows.row(r)``); ``info`` holds
    what the preparation reports (`lctrain.data.prepare.rows_summary`)."""

    def __init__(self, stream: TokenStream, plan: RowPlan, *, seq_len: int, document_mask: bool,
                 pad_id: int, info: dict[str, Any] | None = None) -> None:
        self.stream, self.plan = stream, plan
        self.seq_len, self.document_mask, self.pad_id = seq_len, document_mask, pad_id
        self.info = dict(info or {})

    def __len__(self) -> int:
        return len(self.plan)

    def row(self, r: int) -> dict[str, np.ndarray]:
        """Row ``r``: input_ids, labels, position_ids (S,) int64 and doc_lens."""
        if not 0 <= r < len(self):
            raise IndexError(f"row {r} of {len(self)}")
        spans = [(a, b) for _, a, b in self.pieces(r)]
        ids = np.concatenate([self.stream.ids[a:b] for a, b in spans]).astype(np.int64)  # (n,)
        pad = self.seq_len - ids.size
        if self.document_mask:
            labels = np.concatenate([self._labels_within_samples(a, b) for a, b in spans])
            doc_lens = [b - a for a, b in spans] + ([pad] if pad else [])
        else:
            flags = np.concatenate([self.stream.targets[a:b] for a, b in spans]).astype(bool)
            labels = np.full(ids.size, IGNORE, dtype=np.int64)
            labels[:-1] = np.where(flags[1:], ids[1:], IGNORE)
            doc_lens = [self.seq_len]
        doc_lens = np.asarray(doc_lens, dtype=np.int64)
        starts = np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)  # (S,) own segment's start
        return {"input_ids": np.concatenate([ids, np.full(pad, self.pad_id, np.int64)]),
                "labels": np.concatenate([labels, np.full(pad, IGNORE, np.int64)]),
                "position_ids": np.arange(self.seq_len, dtype=np.int64) - starts,
                "doc_lens": doc_lens}

    __getitem__ = row

    def attention_work(self) -> np.ndarray:
        """(rows,) int64 Σ n² over each row's documents (its pieces), the padding counted as one:
        what its masked attention costs, up to a constant."""
        lengths = self.plan.stops - self.plan.starts  # (pieces,)
        row = np.repeat(np.arange(len(self)), np.diff(self.plan.offsets))
        work = np.bincount(row, lengths ** 2, minlength=len(self))
        pad = self.seq_len - np.bincount(row, lengths, minlength=len(self))
        return (work + pad ** 2).astype(np.int64)

    def _labels_within_samples(self, a: int, b: int) -> np.ndarray:
        """Labels of stream positions a..b-1 within their samples."""
        bounds = self.stream.bounds
        nxt = np.arange(a + 1, b + 1, dtype=np.int64)  # (n,)
        sample_end = bounds[np.searchsorted(bounds, nxt - 1, side="right")]
        at = np.minimum(nxt, bounds[-1] - 1)
        ok = (nxt < sample_end) & self.stream.targets[at].astype(bool)
        return np.where(ok, self.stream.ids[at], IGNORE).astype(np.int64)

    def pieces(self, r: int) -> list[tuple[int, int, int]]:
        """Row ``r``'s (sample, start, stop) spans of the stream."""
        lo, hi = int(self.plan.offsets[r]), int(self.plan.offsets[r + 1])
        starts, stops = self.plan.starts[lo:hi], self.plan.stops[lo:hi]
        samples = np.searchsorted(self.stream.bounds, starts, "right") - 1
        return list(zip(samples.tolist(), starts.tolist(), stops.tolist()))


def pack(samples: Sequence[Sequence[int]], *, seq_len: int, document_mask: bool, pad_id: int,
         targets: Sequence[Sequence[bool]] | None = None, long_samples: str = "split") -> PackedRows:
    """Pack in-memory samples (token id lists; ``targets`` default: all) into rows."""
    lengths = [len(x) for x in samples]
    ids = np.fromiter((t for x in samples for t in x), dtype=np.int32, count=sum(lengths))
    flags = (np.ones(ids.size, bool) if targets is None else
             np.fromiter((bool(t) for x in targets for t in x), dtype=bool, count=ids.size))
    stream = TokenStream(ids, flags, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    return PackedRows(stream, plan_rows(stream, seq_len, long_samples), seq_len=seq_len,
                      document_mask=document_mask, pad_id=pad_id)


_COLUMNS = ("input_ids", "labels", "position_ids")


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch of packed rows (global, or one cp rank's shard of it)."""

    input_ids: torch.Tensor  # (B, S) int64
    labels: torch.Tensor  # (B, S) int64, already shifted; -100 = no loss
    position_ids: torch.Tensor  # (B, S) int64, global (restarting per document when masked)
    cu_seqlens: tuple[int, ...] | None  # global document bounds (0, ..., S); None: one a row

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with its tensors on ``device``."""
        return PackedBatch(*(getattr(self, n).to(device, non_blocking=True) for n in _COLUMNS),
                           cu_seqlens=self.cu_seqlens)

    def label_tokens(self) -> torch.Tensor:
        """Positions that carry a label (0-dim tensor, not synced to host)."""
        return (self.labels != -100).sum()


def iter_batches(ds: PackedRows, *, batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 start_step: int = 0, grad_accum: int = 1) -> Iterator[PackedBatch]:
    """Yield this dp rank's unsharded (batch_size, S) micro-batches forever, from micro-step
    ``start_step`` on, each epoch shuffled by ``seed``; document-masked rows grouped into steps
    by attention work (:func:`epoch_order`)."""
    n_rows = len(ds)
    if n_rows == 0:
        raise DataError("the packed data has no rows; check data.source")
    if min(batch_size, dp_size, grad_accum) < 1 or not 0 <= dp_rank < dp_size or start_step < 0:
        raise ValueError(f"bad batch geometry: batch_size={batch_size}, dp_rank={dp_rank}, "
                         f"dp_size={dp_size}, grad_accum={grad_accum}, start_step={start_step}")
    work = ds.attention_work() if ds.document_mask else None
    order = functools.lru_cache(2)(lambda epoch: epoch_order(
        n_rows, seed, epoch, work, dp_size * batch_size * grad_accum))
    for step in itertools.count(start_step):
        first = (step * dp_size + dp_rank) * batch_size
        yield _collate([ds.row(int(order(j // n_rows)[j % n_rows]))
                        for j in range(first, first + batch_size)])


def eval_batches(ds: PackedRows, *, batch_size: int, dp_rank: int, dp_size: int,
                 limit: int | None = None) -> Iterator[PackedBatch]:
    """This dp rank's evaluation batches: every row (of the first ``limit``) once, in order; the
    same count on every rank (FSDP2 forwards run in step), row 0 unlabelled past the last row."""
    n_rows = len(ds) if limit is None else min(limit, len(ds))
    if n_rows == 0:
        raise DataError("the evaluation data has no rows; check its source")
    for step in range(-(-n_rows // (dp_size * batch_size))):
        first = (step * dp_size + dp_rank) * batch_size
        rows = [ds.row(r) if r < n_rows else {**ds.row(0), "labels": np.full(ds.seq_len, IGNORE)}
                for r in range(first, first + batch_size)]
        yield _collate(rows)


def plan_steps(*, rows: int, rows_per_step: int, max_steps: int | None,
               epochs: float | None) -> int:
    """Optimizer steps of a run: the fewer of ``max_steps`` and ``epochs`` passes over
    ``rows`` (rounded up), one epoch when neither is set. ``rows_per_step`` is
    dp × batch_size × grad_accum."""
    if epochs is None and max_steps is not None:
        return max_steps
    by_epochs = max(1, math.ceil((1.0 if epochs is None else epochs) * rows / rows_per_step - 1e-9))
    return by_epochs if max_steps is None else min(max_steps, by_epochs)


def steps_summary(*, rows: int, rows_per_step: int, steps: int, max_steps: int | None,
                  epochs: float | None) -> list[str]:
    """Banner lines: steps, why, the epochs; a warning when a step takes more rows than exist."""
    if epochs is None and max_steps is not None:
        why = "train.max_steps"
    elif epochs is None:
        why = "one epoch: train.max_steps and train.epochs are both null"
    elif max_steps is not None and steps == max_steps:
        why = f"train.max_steps, reached before train.epochs {epochs:g}"
    else:
        why = f"train.epochs {epochs:g}"
    lines = [f"steps: {steps:,} × {rows_per_step:,} row{'s' * (rows_per_step != 1)} = "
             f"{steps * rows_per_step / rows:.2f} epochs of {rows:,} rows ({why})"]
    if rows < rows_per_step:
        lines.append(f"warning: the data makes {rows:,} packed row{'s' * (rows != 1)} but one step "
                     f"takes {rows_per_step:,} (dp × batch_size × grad_accum), so every step "
                     f"trains on the same rows again; add data or lower train.grad_accum")
    return lines


BALANCE_STEPS = 16  # optimizer steps whose rows are grouped by attention work


def epoch_order(n_rows: int, seed: int, epoch: int = 0, work: np.ndarray | None = None,
                rows_per_step: int = 1) -> np.ndarray:
    """The row numbers that epoch ``epoch`` of :func:`iter_batches` reads: a permutation drawn
    from ``(seed, epoch)`` whose rows, given their attention ``work``, are ranked by it within
    every ``BALANCE_STEPS`` steps of ``rows_per_step`` (the global batch) and dealt to those
    steps in random order, neighbours together, so that a step's dp ranks wait little."""
    order = np.random.default_rng([seed, epoch]).permutation(n_rows)
    if work is None or rows_per_step == 1 or np.ptp(work) == 0:
        return order
    rng, span = np.random.default_rng([seed, epoch, 1]), BALANCE_STEPS * rows_per_step
    for lo in range(min(n_rows, -epoch * n_rows % rows_per_step), n_rows, span):
        ranked = order[lo:lo + span][np.argsort(-work[order[lo:lo + span]], kind="stable")]
        steps = ranked.size // rows_per_step
        dealt = ranked[:steps * rows_per_step].reshape(steps, rows_per_step)[rng.permutation(steps)]
        order[lo:lo + span] = np.concatenate([dealt.reshape(-1), ranked[dealt.size:]])
    return order


def _collate(rows: list[dict[str, np.ndarray]]) -> PackedBatch:
    tensors = [torch.from_numpy(np.stack([np.asarray(r[n], dtype=np.int64) for r in rows]))
               for n in _COLUMNS]  # (B, S) each
    bounds = {tuple(int(x) for x in np.cumsum([0, *r["doc_lens"]])) for r in rows}
    if len(bounds) > 1:
        raise ValueError("the rows of one batch have different document boundaries; use "
                         "batch_size 1 with document_mask")
    (cu_seqlens,) = bounds
    return PackedBatch(*tensors, cu_seqlens=None if len(cu_seqlens) == 2 else cu_seqlens)


def reorder_documents(batch: PackedBatch, order) -> PackedBatch:
    """``batch`` with its documents in ``order`` (every column moved with its tokens,
    ``cu_seqlens`` following); the identity order returns ``batch`` itself."""
    order = [int(i) for i in order]
    if order == list(range(len(order))):
        return batch
    bounds = batch.cu_seqlens
    index = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in order])
    lengths = [bounds[i + 1] - bounds[i] for i in order]
    return PackedBatch(*(getattr(batch, n)[:, index] for n in _COLUMNS),
                       cu_seqlens=tuple(int(x) for x in np.cumsum([0, *lengths])))


def shard_batch(batch: PackedBatch, *, cp_rank: int, cp_size: int, layout: str) -> PackedBatch:
    """This cp rank's part of ``batch`` in the attention's ``layout`` ("contiguous" or
    "zigzag"): (B, S / cp_size) tensors, cu_seqlens unchanged (global)."""
    from lctrain_kernels.distributed import shard

    parts = [shard(getattr(batch, n), layout=layout, dim=1, rank=cp_rank, world_size=cp_size)
             for n in _COLUMNS]
    return PackedBatch(*parts, cu_seqlens=batch.cu_seqlens)
