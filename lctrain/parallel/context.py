"""One run's context parallelism: how each sequence is cut over the cp ranks, and how attention
spans the cut. ``cp.attention`` names the "lctrain" attention (`lctrain.model.attention`), which
runs `lctrain_kernels.dist_attention` over the cp group of each call's `CPContext`
(``cp.context(shard)``); ``cp.shard(batch)`` gives this rank's tokens in the schedule's layout.
With cp = 1 it is plain local causal attention (documents kept apart)."""
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
    """How one rank holds and attends over its part of every sequence: the mesh's cp group carries
    the attention's transfers; heads run in ``head_groups`` one after the other; ``balance``
    (training) reorders each row's documents so the ranks' attention work is even.

    ``layout`` is how the schedule lays a sequence out over the cp ranks (the data is cut so);
    ``work_balance`` the busiest rank's attention work over the mean in the last batch :meth:`shard`
    cut (None unless cp > 1 with documents); ``attention`` the ``attn_implementation`` the model
    must be built with (registered here)."""

    def __init__(self, mesh: ParallelMesh, schedule: str, backend: str, *,
                 device: torch.device, head_groups: int = 1, balance: bool = False) -> None:
        self.mesh, self.schedule, self.backend, self.device = mesh, schedule, backend, device
        self.head_groups, self.balance = head_groups, balance and mesh.cp > 1
        self.work_balance: float | None = None
        self.layout = schedule_layout(schedule)
        self.attention = register_attention()

    def shard(self, batch: PackedBatch) -> PackedBatch:
        """This rank's (B, S / cp) part of a global (B, S) micro-batch in the schedule's layout,
        on its device; position ids and ``cu_seqlens`` stay global (of any balanced order)."""
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
        """What the model's attention calls need for ``shard`` (pass it as ``cp_context=``)."""
        return CPContext(group=self.mesh.cp_group, cu_seqlens=shard.cu_seqlens,
                         schedule=self.schedule, backend=self.backend,
                         head_groups=self.head_groups)

    def check_model(self, config) -> None:
        """UserError when ``parallel.head_groups`` does not divide the model's key/value heads."""
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        if isinstance(kv, int) and kv % self.head_groups:
            raise UserError(f"parallel.head_groups is {self.head_groups} but must divide the "
                            f"model's {kv} key/value heads; use one of "
                            f"{', '.join(str(g) for g in range(1, kv + 1) if kv % g == 0)}")
