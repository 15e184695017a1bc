"""Forward-only passes over packed rows on the training's own distributed path, without
gradients; each rank sums its figures in float64 and one all-reduce makes them global, so the
results do not depend on dp, cp or batch size."""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from lctrain.data import IGNORE, PackedBatch, PackedRows, eval_batches
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.mesh import ParallelMesh


def forward_sums(call: Callable[[PackedBatch], torch.Tensor], batches: Iterable[PackedBatch], *,
                 cp: ContextParallel, pmesh: ParallelMesh, accelerator: Accelerator,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """Σ over ranks of ``call(shard)`` on this rank's ``batches``, without gradients (float64)."""
    total = torch.zeros(shape, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for batch in batches:
            shard = cp.shard(batch)
            with accelerator.autocast():
                total += call(shard).double()
    if pmesh.world_group is not None and pmesh.world_size > 1:
        dist.all_reduce(total, group=pmesh.world_group)
    return total


def validation_loss(module: nn.Module, rows: PackedRows, *, cp: ContextParallel,
                    pmesh: ParallelMesh, accelerator: Accelerator, batch_size: int) -> float:
    """Mean token loss over all ``rows`` (a collective); NaN without a target."""
    def call(shard: PackedBatch) -> torch.Tensor:
        loss = module(shard.input_ids, shard.labels, shard.position_ids,
                      cp_context=cp.context(shard))
        return torch.stack([loss.double(), shard.label_tokens().double()])

    was_training = module.training
    module.eval()
    try:
        batches = eval_batches(rows, batch_size=batch_size, dp_rank=pmesh.dp_rank, dp_size=pmesh.dp)
        loss_sum, count = forward_sums(call, batches, cp=cp, pmesh=pmesh,
                                       accelerator=accelerator, shape=(2,)).tolist()
    finally:
        module.train(was_training)
    return loss_sum / count if count else math.nan


def bucket_sums(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                positions: torch.Tensor, *, width: int, buckets: int,
                chunk_tokens: int) -> torch.Tensor:
    """(2, buckets) float64: Σ loss and targets per ``positions // width`` bucket, of ``hidden``
    through ``weight`` against shifted ``labels``, ``chunk_tokens`` logits at a time."""
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    y, pos = labels.reshape(-1), positions.reshape(-1)  # (N,)
    out = torch.zeros(2, buckets, dtype=torch.float64, device=hidden.device)
    for start in range(0, h.shape[0], chunk_tokens):
        stop = min(start + chunk_tokens, h.shape[0])
        valid = y[start:stop] != IGNORE  # (C,)
        target = torch.where(valid, y[start:stop], 0).unsqueeze(1)  # (C, 1)
        logits = (h[start:stop] @ weight.T).float()  # (C, V)
        loss = torch.logsumexp(logits, dim=-1) - logits.gather(1, target).squeeze(1)  # (C,)
        where = (pos[start:stop] // width).clamp(max=buckets - 1)  # (C,)
        out[0].index_add_(0, where, torch.where(valid, loss, 0.0).double())
        out[1].index_add_(0, where, valid.double())
    return out
