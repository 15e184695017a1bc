"""One run's context parallelism: how each sequence is cut over the cp ranks, and how attention
spans the cut.

    cp = ContextParallel(pmesh, "distflash", "auto", device=device)
    model = load_model(..., attn_implementation=cp.attention)   # the schedule's attention
    shard = cp.shard(batch)              # this rank's tokens, in the schedule's layout, on device
    loss = module(shard.input_ids, shard.labels, shard.position_ids,
                  cp_context=cp.context(shard))

The model's "lctrain" attention function (`lctrain.model.attention`) runs
`lctrain_kernels.dist_attention` over the cp group named in each call's `CPContext`; with
cp = 1 it is plain local causal attention (documents kept apart).
"""
from __future__ import annotations

import numpy as np
import torch
from lctrain_kernels.distributed import balanced_order, work_balance
from lctrain_kernels.vocabulary import schedule_layout

from lctrain.data import PackedBatch, reorder_documents, shard_batch
from lctrain.errors import UserError
from lctrain.model.attention import CPContext, register_attention
from lctrain.parallel.mesh import ParallelMesh


class ContextParallel:
    """How one rank holds and attends over its part of every sequence.

    Args:
        mesh: the run's dp × cp mesh (its cp group carries the attention's transfers).
        schedule: ``distflash`` or ``zigzag`` (or another of lctrain_kernels' schedules).
        backend: the local attention backend ("auto", "triton", ...).
        device: this rank's device (shards are moved there).
        head_groups: attention heads run in this many groups one after the other.
        balance: reorder each row's documents so the ranks' attention work is even (cp > 1,
            rows of several documents; `lctrain.data.reorder_documents`); training does.

    Attributes:
        layout: how the schedule lays a sequence out over the cp ranks (``contiguous`` or
            ``zigzag``); the data is cut in this layout.
        work_balance: of the last batch :meth:`shard` cut (cp > 1, rows of documents; else
            None): the busiest rank's attention work over the mean, after any reordering (1.0 is
            even).
        attention: the transformers attention function (``attn_implementation``) the model
            must be built with, registered in transformers' AttentionInterface here.
    """

    def __init__(self, mesh: ParallelMesh, schedule: str, backend: str, *,
                 device: torch.device, head_groups: int = 1, balance: bool = False) -> None:
        self.mesh, self.schedule, self.backend, self.device = mesh, schedule, backend, device
        self.head_groups, self.balance = head_groups, balance and mesh.cp > 1
        self.work_balance: float | None = None
        self.layout = schedule_layout(schedule)
        self.attention = register_attention()

    def shard(self, batch: PackedBatch) -> PackedBatch:
        """This rank's part of a global micro-batch along the sequence, on this rank's device.

        Args:
            batch: (B, S) global rows, labels shifted before the cut.

        Returns:
            (B, S / cp) tensors in the schedule's layout; position ids and ``cu_seqlens`` global
            (of the balanced order, when the documents were reordered).
        """
        self.work_balance = None
        if self.mesh.cp > 1 and batch.cu_seqlens is not None:
            seq, cp = int(batch.cu_seqlens[-1]), self.mesh.cp
            if self.balance:
                order = balanced_order(np.diff(batch.cu_seqlens), seq, cp, self.schedule)
                batch = reorder_documents(batch, order)
            self.work_balance = work_balance(np.diff(batch.cu_seqlens), seq, cp, self.schedule)
        return shard_batch(batch, cp_rank=self.mesh.cp_rank, cp_size=self.mesh.cp,
                           layout=self.layout).to(self.device)

    def context(self, shard: PackedBatch) -> CPContext:
        """What each attention call of the model needs to know for ``shard`` (pass it to the
        model as ``cp_context=``)."""
        return CPContext(group=self.mesh.cp_group, cu_seqlens=shard.cu_seqlens,
                         schedule=self.schedule, backend=self.backend,
                         head_groups=self.head_groups)

    def check_model(self, config) -> None:
        """Refuse head groups that do not divide the model's key/value heads.

        Raises:
            UserError: ``parallel.head_groups`` is not a divisor of the key/value heads.
        """
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        if isinstance(kv, int) and kv % self.head_groups:
            raise UserError(f"parallel.head_groups is {self.head_groups} but must divide the "
                            f"model's {kv} key/value heads; use one of "
                            f"{', '.join(str(g) for g in range(1, kv + 1) if kv % g == 0)}")
