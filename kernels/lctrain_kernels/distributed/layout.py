"""How a global sequence maps onto the ranks of a sequence-parallel group, for the attention
executor, the data pipeline and the tests. A rank's local tensor is its chunks concatenated in
order: chunk r of P ("contiguous"), or chunk r then chunk 2P−1−r of 2P ("zigzag": a head and the
mirrored tail, so every rank has the same causal work)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from lctrain_kernels.vocabulary import check_seq_len, chunks_per_rank


def layout_positions(seq_len: int, world_size: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """Global ``(start, stop)`` spans held by ``rank`` of ``world_size``, in local order: one
    for "contiguous", two (head, tail) for "zigzag"; ValueError for a bad layout, rank or length."""
    chunk = check_seq_len(seq_len, world_size, layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of {world_size} ranks")
    chunks = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]  # head, tail
    return [(c * chunk, (c + 1) * chunk) for c in chunks]


def local_spans(seq_len: int, world_size: int, rank: int, layout: str,
                start: int, stop: int) -> list[tuple[int, int, int]]:
    """Local rows ``[start, stop)`` of ``rank`` as ``[(local_start, global_start, length)]``."""
    pieces, offset = [], 0
    for g0, g1 in layout_positions(seq_len, world_size, rank, layout):
        lo, hi = max(start, offset), min(stop, offset + g1 - g0)
        if lo < hi:
            pieces.append((lo, g0 + lo - offset, hi - lo))
        offset += g1 - g0
    return pieces


def shard_indices(seq_len: int, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """Global positions of ``rank``'s tokens in local order, int64 of shape (N/P,)."""
    spans = layout_positions(seq_len, world_size, rank, layout)
    return torch.cat([torch.arange(a, b, dtype=torch.long) for a, b in spans])  # (N/P,)


def global_order(seq_len: int, world_size: int, layout: str) -> torch.Tensor:
    """Global position of every row of the rank-major all-gather, int64 of shape (N,)."""
    return torch.cat([shard_indices(seq_len, world_size, r, layout) for r in range(world_size)])


def _rank_and_size(group, rank, world_size) -> tuple[int, int]:
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither")
    if rank is not None:
        return rank, world_size
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def shard(x: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1, *,
          rank: int | None = None, world_size: int | None = None) -> torch.Tensor:
    """This rank's tokens of ``x`` (the full tensor, the same on every rank, sequence along
    ``dim``), in local order: contiguous, differentiable. ``group`` None: one rank; ``rank``,
    ``world_size`` override the group's. ValueError for a bad layout or length."""
    rank, world_size = _rank_and_size(group, rank, world_size)
    dim = dim % x.dim()
    spans = layout_positions(x.shape[dim], world_size, rank, layout)
    parts = [x.narrow(dim, a, b - a) for a, b in spans]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim)).contiguous()


class _Unshard(torch.autograd.Function):
    """All-gather + reorder; its backward sums every rank's gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x_local, group, layout, dim):
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(parts, x_local.contiguous(), group=group)
        gathered = torch.cat(parts, dim)  # (..., N, ...) rank-major
        order = global_order(gathered.shape[dim], world, layout).to(x_local.device)
        ctx.group, ctx.layout, ctx.dim = group, layout, dim
        return gathered.index_select(dim, torch.argsort(order))  # (..., N, ...) global order

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return shard(grad, ctx.group, ctx.layout, ctx.dim), None, None, None


def unshard(x_local: torch.Tensor, group=None, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The full-sequence tensor on every rank from each rank's rows (as :func:`shard` gave
    them). Differentiable: the gradient is summed over the ranks and each keeps its rows. None
    (or one rank) returns ``x_local`` unchanged; ValueError for a bad layout."""
    chunks_per_rank(layout)
    if group is None or dist.get_world_size(group) == 1:
        return x_local
    dim = dim % x_local.dim()
    return _Unshard.apply(x_local, group, layout, dim)
