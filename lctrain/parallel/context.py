"""One run's context parallelism: how each sequence is cut over the cp ranks, and how attention
spans the cut.

    cp = ContextParallel(pmesh, "distflash", "auto", device=device)
    model = load_model(..., attn_implementation=cp.attention)   # the schedule's attention
    shard = cp.shard(batch)              # this rank's tokens, in the schedule's layout, on device
    with cp.session(shard):              # around the forward AND the backward
        loss = module(shard.input_ids, shard.labels, shard.position_ids,
                      cp_context=cp.context(shard))
        loss.backward()

Schedules:

- lctrain's own (``distflash``, ``ring``, ``zigzag``): the "lctrain" attention function
  (`lctrain.model.attention`) runs `lctrain_kernels.dist_attention` over the cp group named in
  each call's `CPContext`; nothing needs to be active around a micro-batch.
- ``context_parallel``, torch's ring (`lctrain.parallel.torch_cp`), the peer lctrain is measured
  against: it registers its own attention function, and torch's context must be active around
  each micro-batch's forward and backward (the session).

With cp = 1 every schedule is plain local causal attention (documents kept apart).
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import numpy as np
import torch
from lctrain_kernels.distributed.balance import balanced_order, work_balance

from lctrain.config import SCHEDULE_LAYOUTS
from lctrain.data import PackedBatch, reorder_documents, shard_batch
from lctrain.errors import UserError
from lctrain.model.attention import CPContext, register_attention
from lctrain.parallel import torch_cp
from lctrain.parallel.mesh import ParallelMesh

TORCH_PEER = "context_parallel"
"""The schedule that runs torch's own context parallelism instead of lctrain's kernels."""


def check_runnable(schedule: str, cp: int, device_type: str) -> None:
    """Raise a UserError if ``schedule`` cannot split sequences over ``cp`` ranks on this device.

    Raises:
        UserError: torch's peer schedule on a machine without CUDA.
    """
    if schedule == TORCH_PEER and cp > 1:
        torch_cp.check_available(device_type)


class ContextParallel:
    """How one rank holds and attends over its part of every sequence.

    Args:
        mesh: the run's dp × cp mesh (its cp group carries the attention's transfers).
        schedule: ``distflash``, ``ring``, ``zigzag`` or ``context_parallel``.
        backend: the local attention backend of lctrain's schedules ("auto", "triton", ...).
        device: this rank's device (shards are moved there).
        head_groups: attention heads run in this many groups one after the other (lctrain's
            schedules; bounds the attention's buffers).
        balance: reorder each row's documents so the ranks' attention work is even (lctrain's
            schedules, cp > 1, rows of several documents; `lctrain.data.reorder_documents`).

    Attributes:
        layout: how the schedule lays a sequence out over the cp ranks (``contiguous`` or
            ``zigzag``); the data is cut in this layout.
        work_balance: of the last batch :meth:`shard` cut (lctrain's schedules, cp > 1, rows of
            documents; else None): the busiest rank's attention work over the mean, after
            any reordering (1.0 is even).
        attention: the transformers attention function (``attn_implementation``) the model
            must be built with, registered in transformers' AttentionInterface here.

    Raises:
        UserError: the schedule cannot run on this device (see `check_runnable`).
    """

    def __init__(self, mesh: ParallelMesh, schedule: str, backend: str, *,
                 device: torch.device, head_groups: int = 1, balance: bool = False) -> None:
        check_runnable(schedule, mesh.cp, device.type)
        self.mesh, self.schedule, self.backend, self.device = mesh, schedule, backend, device
        self.head_groups = head_groups
        self.balance = balance and mesh.cp > 1 and schedule != TORCH_PEER
        self.work_balance: float | None = None
        self.layout = SCHEDULE_LAYOUTS[schedule]
        self._peer = (torch_cp.TorchContextParallel(mesh.mesh["cp"], mesh.cp_rank, device)
                      if schedule == TORCH_PEER and mesh.cp > 1 else None)
        self.attention = (torch_cp.register_attention() if self._peer is not None
                          else register_attention())

    def shard(self, batch: PackedBatch) -> PackedBatch:
        """This rank's part of a global micro-batch along the sequence, on this rank's device.

        Args:
            batch: (B, S) global rows, labels shifted before the cut.

        Returns:
            (B, S / cp) tensors in the schedule's layout; position ids and ``cu_seqlens`` global
            (of the balanced order, when the documents were reordered).
        """
        self.work_balance = None
        if self.mesh.cp > 1 and self.schedule != TORCH_PEER and batch.cu_seqlens is not None:
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

    def session(self, shard: PackedBatch) -> ContextManager[None]:
        """What must be active around one micro-batch's forward and backward: torch's context for
        the peer schedule, nothing for lctrain's own."""
        if self._peer is None:
            return contextlib.nullcontext()
        return self._peer.session(shard.input_ids.shape[1] * self.mesh.cp)
