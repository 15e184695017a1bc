"""Distributed attention in the style of DistFlashAttn (arXiv 2310.03294).

The sequence is split across the ranks of a process group (``layout``), a pure-Python
``schedule`` says which rank computes which attention block at which step and what travels
where, ``comm`` moves the tensors point to point, ``executor`` runs a schedule's plan with any
local backend, and ``op`` makes that, forward and backward, the custom op
``lctrain::dist_attention`` behind :func:`lctrain_kernels.dist_attention` (and, on a group of
one, behind :func:`lctrain_kernels.attention`).

    q_loc = shard(q, group=pg, layout=make_schedule(P).layout, dim=1)       # (B, S/P, Hq, D)
    out_loc = dist_attention(q_loc, k_loc, v_loc, group=pg, causal=True)    # (B, S/P, Hq, D)
    out = unshard(out_loc, group=pg, layout="contiguous", dim=1)            # (B, S, Hq, D)

On GPUs, create the group with ``pg_options=nccl_options()`` (high-priority NCCL streams) so
the transfers overlap the attention kernels (see ``comm``).
"""
import lctrain_kernels.distributed.op  # noqa: F401 - registers torch.ops.lctrain.dist_attention*
from lctrain_kernels.distributed.comm import nccl_options
from lctrain_kernels.distributed.layout import (
    global_order,
    layout_positions,
    local_spans,
    shard,
    shard_indices,
    unshard,
)
from lctrain_kernels.distributed.schedule import Schedule, make_schedule
from lctrain_kernels.vocabulary import LAYOUTS, SCHEDULES, chunks_per_rank

__all__ = [
    "LAYOUTS", "SCHEDULES", "Schedule", "chunks_per_rank", "dist_attention",
    "dist_attention_with_lse", "global_order", "layout_positions", "local_spans", "make_schedule",
    "nccl_options", "shard", "shard_indices", "unshard",
]


def __getattr__(name: str):
    """``dist_attention`` / ``dist_attention_with_lse`` from :mod:`lctrain_kernels.api` (which
    imports this package, hence on first use)."""
    if name in ("dist_attention", "dist_attention_with_lse"):
        from lctrain_kernels import api

        return getattr(api, name)
    raise AttributeError(f"module 'lctrain_kernels.distributed' has no attribute {name!r}")
