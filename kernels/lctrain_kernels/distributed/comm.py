"""Point-to-point exchange of one schedule step, posted as one batch and waited on later.

A message is a list of tensors, each sent as a flat byte view (contiguous first if needed, as gloo
wants) and received into fresh tensors the receiver allocates from the same plan, so every send
meets its receive in the same batch. The executor waits one step later, so the transfer runs while
the current block computes. On NCCL the communicator must exist before the first batch, and
:func:`nccl_options` gives its streams high priority, so transfers go ahead of queued compute."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

_PER_MESSAGE = 8  # tensors of one message are tagged tag * _PER_MESSAGE + index

Spec = tuple[tuple[int, ...], torch.dtype]
_ends: deque = deque()  # where the GPU ends the latest attention calls


def bound_host_lead(device: torch.device, calls: int = 2) -> None:
    """Wait until the GPU has finished the attention call ``calls`` before this one. NCCL records
    the tensors of point-to-point transfers on its stream and the allocator reuses their memory
    only once that stream is past them, so a host far ahead holds every layer's messages."""
    if device.type == "cuda":
        _ends.append(torch.cuda.current_stream(device).record_event())
        while len(_ends) > calls:
            _ends.popleft().synchronize()


def nccl_options(timeout: timedelta | None = None):
    """``ProcessGroupNCCL.Options`` with high-priority streams (and ``timeout`` when given) for
    the group of the attention's transfers, for ``init_process_group`` / ``new_group`` or a
    DeviceMesh ``backend_override``; None when this torch has no NCCL."""
    if not dist.is_available() or not dist.is_nccl_available():
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    if timeout is not None:
        options._timeout = timeout
    return options


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t``'s elements (a contiguous copy first if needed)."""
    return t.contiguous().view(-1).view(torch.uint8)


@dataclass
class Pending:
    """Posted transfers of one batch; :meth:`wait` before touching the received tensors."""

    works: list = field(default_factory=list)
    received: list[list[torch.Tensor]] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)  # kept alive until waited

    def wait(self) -> list[list[torch.Tensor]]:
        """Order the current stream after the transfers (no host sync on CUDA); return recvs."""
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []
        return self.received


class Exchanger:
    """Posts batches of point-to-point transfers inside ``group`` (None: one rank)."""

    def __init__(self, group):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self._global = [0] if group is None else [dist.get_global_rank(group, r)
                                                  for r in range(self.world_size)]

    def post(self, sends: list[tuple[list[torch.Tensor], int, int]],
             recvs: list[tuple[list[Spec], int, int]], device: torch.device) -> Pending:
        """Post every send ``(tensors, dst, tag)`` and receive ``(specs, src, tag)`` of a batch
        without waiting; a send and its receive share a tag (gloo matches on it), empty tensors
        travel as nothing. The :class:`Pending`'s ``received`` lists follow ``recvs``."""
        received = [[torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
                    for specs, _, _ in recvs]
        pending = Pending(received=received)
        ops = []
        for tensors, dst, tag in sends:
            for i, t in enumerate(tensors):
                if t.numel():
                    buf = _bytes(t)
                    pending.sent.append(buf)
                    ops.append(dist.P2POp(dist.isend, buf, self._global[dst], self.group,
                                          tag=tag * _PER_MESSAGE + i))
        for tensors, (_, src, tag) in zip(received, recvs):
            for i, t in enumerate(tensors):
                if t.numel():
                    ops.append(dist.P2POp(dist.irecv, _bytes(t), self._global[src], self.group,
                                          tag=tag * _PER_MESSAGE + i))
        if ops:
            pending.works = list(dist.batch_isend_irecv(ops))
        return pending
