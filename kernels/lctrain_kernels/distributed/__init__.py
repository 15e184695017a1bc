"""Distributed attention in the style of DistFlashAttn (arXiv 2310.03294): ``layout`` splits the
sequence over a group's ranks, ``schedule`` says which rank computes which block when, ``comm``
moves tensors, ``executor`` runs a plan with any local backend, ``op`` makes that the custom op
behind :func:`lctrain_kernels.dist_attention`, ``balance`` orders packed documents. On GPUs create
the group with ``pg_options=nccl_options()`` so transfers overlap the kernels."""
from lctrain_kernels.distributed.balance import balanced_order, document_work, work_balance
from lctrain_kernels.distributed.comm import nccl_options
from lctrain_kernels.distributed.layout import (global_order, layout_positions, local_spans, shard,
                                                shard_indices, unshard)
from lctrain_kernels.distributed.op import messages_only  # registers torch.ops.lctrain.dist_attention*
from lctrain_kernels.distributed.schedule import Schedule, make_schedule
from lctrain_kernels.vocabulary import LAYOUTS, SCHEDULES, chunks_per_rank

__all__ = [
    "LAYOUTS", "SCHEDULES", "Schedule", "balanced_order", "chunks_per_rank", "dist_attention",
    "dist_attention_with_lse", "document_work", "global_order", "layout_positions",
    "local_spans", "make_schedule", "messages_only", "nccl_options", "shard", "shard_indices",
    "unshard", "work_balance",
]


def __getattr__(name: str):
    """``dist_attention`` / ``dist_attention_with_lse`` from :mod:`lctrain_kernels.api`."""
    if name in ("dist_attention", "dist_attention_with_lse"):
        from lctrain_kernels import api

        return getattr(api, name)
    raise AttributeError(f"module 'lctrain_kernels.distributed' has no attribute {name!r}")
