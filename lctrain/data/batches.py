"""Batches of packed rows: a deterministic, resumable order, and the split along the sequence.

Order: the packed rows form an endless stream of epochs, each a fresh permutation drawn from
``(seed, epoch)``. Micro-step k takes the ``batch_size × dp_size`` stream entries starting at
``k × batch_size × dp_size``; dp rank d takes its ``batch_size`` consecutive entries of them. So
every rank sees disjoint rows, every row is seen once per epoch, and resuming at ``start_step``
is exact and costs nothing (no batches are drawn to be thrown away).

Sharding: labels were shifted when the rows were packed, so cutting a batch along the sequence
(:func:`shard_batch`, through ``lctrain_kernels.distributed.shard``: the same layout the attention
uses) keeps every label; position ids stay global; ``cu_seqlens`` stays global and identical on
every cp rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import math

import numpy as np
import torch

from lctrain.data.packing import PackedRows
from lctrain.errors import DataError

_COLUMNS = ("input_ids", "labels", "position_ids")


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch of packed rows (global, or one cp rank's shard of it)."""

    input_ids: torch.Tensor
    """(B, S) int64 token ids."""
    labels: torch.Tensor
    """(B, S) int64 next-token targets, already shifted; -100 = no loss."""
    position_ids: torch.Tensor
    """(B, S) int64 GLOBAL positions (restarting per document with document_mask)."""
    cu_seqlens: tuple[int, ...] | None
    """Document boundaries of the whole (unsharded) sequence as host ints ``(0, ..., S)``,
    identical on every cp rank; None when the rows are one segment each (plain causal)."""

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with its tensors on ``device``."""
        return PackedBatch(*(getattr(self, n).to(device, non_blocking=True) for n in _COLUMNS),
                           cu_seqlens=self.cu_seqlens)

    def label_tokens(self) -> torch.Tensor:
        """Number of positions that carry a label (a 0-dim int64 tensor, not synced to host)."""
        return (self.labels != -100).sum()


def iter_batches(ds: PackedRows, *, batch_size: int, dp_rank: int, dp_size: int, seed: int,
                 start_step: int = 0) -> Iterator[PackedBatch]:
    """Yield this dp rank's micro-batches forever, from micro-step ``start_step`` on.

    Args:
        ds: packed rows (`prepare_data` or `pack`).
        batch_size: rows per dp rank per micro-step.
        dp_rank, dp_size: this rank's data-parallel index and the number of dp groups.
        seed: seeds the per-epoch shuffles.
        start_step: the first micro-step to yield (optimizer steps × grad_accum when resuming).

    Yields:
        PackedBatch with (batch_size, S) tensors, unsharded along the sequence.

    Raises:
        DataError: the dataset has no rows.
        ValueError: bad ranks / sizes, or rows of one batch with different document boundaries.
    """
    n_rows = len(ds)
    if n_rows == 0:
        raise DataError("the packed data has no rows; check data.source")
    if batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size or start_step < 0:
        raise ValueError(f"bad batch geometry: batch_size={batch_size}, dp_rank={dp_rank}, "
                         f"dp_size={dp_size}, start_step={start_step}")
    order = _EpochOrder(n_rows, seed)
    step = start_step
    while True:
        first = (step * dp_size + dp_rank) * batch_size
        yield _collate([ds.row(order[j]) for j in range(first, first + batch_size)])
        step += 1


def eval_batches(ds: PackedRows, *, batch_size: int, dp_rank: int, dp_size: int,
                 limit: int | None = None) -> Iterator[PackedBatch]:
    """This dp rank's batches of an evaluation: every row once over all dp ranks, in order.

    Batch k of dp rank d holds rows ``(k × dp_size + d) × batch_size + i``. Every dp rank
    yields the same number of batches, ceil(rows / (dp_size × batch_size)), because the
    forwards of all ranks run in step (FSDP2 gathers parameters over all of them); a slot past
    the last row holds row 0 with every label masked, which adds nothing to any sum.

    Args:
        ds: packed rows.
        batch_size: rows per batch.
        dp_rank, dp_size: this rank's data-parallel index and the number of dp groups.
        limit: evaluate only the first ``limit`` rows (None = all).

    Raises:
        DataError: no rows.
    """
    n_rows = len(ds) if limit is None else min(limit, len(ds))
    if n_rows == 0:
        raise DataError("the evaluation data has no rows; check its source")
    per_step = dp_size * batch_size
    for step in range(-(-n_rows // per_step)):
        first = (step * dp_size + dp_rank) * batch_size
        rows = [ds.row(r) if r < n_rows else _masked(ds.row(0))
                for r in range(first, first + batch_size)]
        yield _collate(rows)


def _masked(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**row, "labels": np.full_like(row["labels"], -100)}


def plan_steps(*, rows: int, rows_per_step: int, max_steps: int | None,
               epochs: float | None) -> int:
    """Optimizer steps of a run: ``max_steps``, the steps of ``epochs`` passes over ``rows``
    (the last step completed from the next pass), whichever is fewer; one epoch when neither
    is set.

    Args:
        rows: packed rows in one epoch.
        rows_per_step: rows one optimizer step takes over all dp ranks
            (dp × batch_size × grad_accum).
        max_steps, epochs: ``train.max_steps`` and ``train.epochs`` (None = not set).
    """
    if epochs is None and max_steps is not None:
        return max_steps
    by_epochs = max(1, math.ceil((1.0 if epochs is None else epochs) * rows / rows_per_step - 1e-9))
    return by_epochs if max_steps is None else min(max_steps, by_epochs)


def steps_summary(*, rows: int, rows_per_step: int, steps: int, max_steps: int | None,
                  epochs: float | None) -> list[str]:
    """Banner lines: how many steps, why, how many epochs they make; and a warning when one
    step takes more rows than the data has (the same rows are then trained on every step)."""
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


class _EpochOrder:
    """Stream index -> row number: epoch e is the permutation drawn from ``(seed, e)``."""

    def __init__(self, n_rows: int, seed: int) -> None:
        self.n_rows, self.seed = n_rows, seed
        self._cache: dict[int, np.ndarray] = {}

    def __getitem__(self, index: int) -> int:
        epoch, offset = divmod(index, self.n_rows)
        if epoch not in self._cache:
            if len(self._cache) > 1:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        return int(self._cache[epoch][offset])


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
    """``batch`` with its documents in ``order`` (indices into its documents), every column
    moved with its tokens: labels were shifted before, position ids restart per document, and
    ``cu_seqlens`` follows the new order. The identity order returns ``batch`` itself."""
    order = [int(i) for i in order]
    if order == list(range(len(order))):
        return batch
    bounds = batch.cu_seqlens
    index = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in order])
    lengths = [bounds[i + 1] - bounds[i] for i in order]
    return PackedBatch(*(getattr(batch, n)[:, index] for n in _COLUMNS),
                       cu_seqlens=tuple(int(x) for x in np.cumsum([0, *lengths])))


def shard_batch(batch: PackedBatch, *, cp_rank: int, cp_size: int, layout: str) -> PackedBatch:
    """This cp rank's part of ``batch`` along the sequence, in the attention's layout.

    Args:
        batch: a global batch from :func:`iter_batches`.
        cp_rank, cp_size: this rank's index in the context-parallel group and its size.
        layout: ``make_schedule(cp_size, kind).layout`` ("contiguous" or "zigzag").

    Returns:
        PackedBatch with (B, S / cp_size) tensors; cu_seqlens unchanged (global).
    """
    from lctrain_kernels.distributed import shard

    parts = [shard(getattr(batch, n), layout=layout, dim=1, rank=cp_rank, world_size=cp_size)
             for n in _COLUMNS]
    return PackedBatch(*parts, cu_seqlens=batch.cu_seqlens)
