"""Forward-only passes over packed rows, on the training's own distributed path.

An evaluation runs exactly what a training step's forward runs — the rows cut with
`ContextParallel.shard` in the schedule's layout, the schedule's session, the accelerator's
autocast, the model's attention over the cp group — under ``torch.no_grad()``, with no
backward. So its memory per GPU stays below a training step's at the same length, and its
numbers are the training's numbers.

Every rank adds up its own figures (sums of token losses, counts of target tokens) in float64
on its device; ONE all-reduce over all dp × cp ranks at the end makes them global, and only
then does anything reach the host. Means are taken from the global sums (Σ loss / Σ targets),
never as means of per-rank or per-row means, so the result is the same for any dp, cp and
batch size. The rows come from `lctrain.data.eval_batches`: each row once over all dp ranks,
every rank taking the same number of batches (the forwards of all ranks run in step: FSDP2
gathers parameters over all of them).

    loss = validation_loss(module, rows, cp=cp, pmesh=pmesh, accelerator=accelerator,
                           batch_size=1)
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from lctrain.data import PackedBatch, PackedRows, eval_batches
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.mesh import ParallelMesh

IGNORE = -100


def forward_sums(call: Callable[[PackedBatch], torch.Tensor], batches: Iterable[PackedBatch], *,
                 cp: ContextParallel, pmesh: ParallelMesh, accelerator: Accelerator,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """Σ of ``call(shard)`` over this rank's batches, summed over all ranks.

    Args:
        call: one forward of a cp shard (inside the session and autocast, without gradients)
            returning figures of ``shape`` to add up.
        batches: this rank's global batches (`lctrain.data.eval_batches`).
        cp: how sequences are cut and attended over.
        pmesh: the ranks (the sum runs over its world group).
        accelerator: autocast.
        shape: the shape of what ``call`` returns.

    Returns:
        float64 tensor of ``shape`` on this rank's device, identical on every rank.
    """
    total = torch.zeros(shape, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for batch in batches:
            shard = cp.shard(batch)
            with cp.session(shard), accelerator.autocast():
                total += call(shard).double()
    if pmesh.world_group is not None and pmesh.world_size > 1:
        dist.all_reduce(total, group=pmesh.world_group)
    return total


def validation_loss(module: nn.Module, rows: PackedRows, *, cp: ContextParallel,
                    pmesh: ParallelMesh, accelerator: Accelerator, batch_size: int) -> float:
    """Mean token loss over all ``rows``: Σ token losses / Σ target tokens (collective).

    Args:
        module: the training's `lctrain.train.loop.CausalLMLoss` (as distributed: its forward
            returns the summed loss of a shard).
        rows: the validation rows.
        cp, pmesh, accelerator: the run's.
        batch_size: rows per forward (the training's ``train.batch_size``).

    Returns:
        The mean loss in nats, or NaN when the rows hold no target token.
    """
    def call(shard: PackedBatch) -> torch.Tensor:
        loss = module(shard.input_ids, shard.labels, shard.position_ids,
                      cp_context=cp.context(shard))
        return torch.stack([loss.double(), shard.label_tokens().double()])

    was_training = module.training
    module.eval()
    try:
        batches = eval_batches(rows, batch_size=batch_size, dp_rank=pmesh.dp_rank,
                               dp_size=pmesh.dp)
        loss_sum, count = forward_sums(call, batches, cp=cp, pmesh=pmesh,
                                       accelerator=accelerator, shape=(2,)).tolist()
    finally:
        module.train(was_training)
    return loss_sum / count if count else math.nan


def bucket_sums(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                positions: torch.Tensor, *, width: int, buckets: int,
                chunk_tokens: int) -> torch.Tensor:
    """Token losses summed per position bucket, without all logits at once.

    A token at position p (its ``position_ids``: where it sits in its document, the same on
    whichever cp rank holds it) falls in bucket ``p // width``; its loss is the cross-entropy of
    its label, computed as `lctrain.train.loss.chunked_cross_entropy` does (fp32 logits of
    ``chunk_tokens`` tokens at a time).

    Args:
        hidden: (B, S, H) final hidden states.
        weight: (V, H) output head, same dtype as ``hidden``.
        labels: (B, S) shifted labels, -100 = no target.
        positions: (B, S) position ids.
        width: tokens per bucket.
        buckets: number of buckets (positions past the last bucket count in it).
        chunk_tokens: tokens whose logits are held at once.

    Returns:
        (2, buckets) float64: Σ loss and the number of targets of each bucket.
    """
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
