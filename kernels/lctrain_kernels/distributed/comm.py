"""Point-to-point exchange of one schedule step, posted as one batch and waited on later.

A message of a step (k and v of a rank, a run of query rows, a partial result, gradients) is a
list of tensors. Each tensor travels as its own send of its bytes (a flat uint8 view of the
tensor, contiguous first if it is not): k and v are sent from where they lie, with no copy
into a staging buffer, and gloo's need for contiguous tensors is met. The receiver allocates
each tensor with its shape and dtype from the same schedule and receives straight into it.

:class:`Exchanger` posts all sends and receives of a step with ``dist.batch_isend_irecv`` and
returns a :class:`Pending` without waiting. The executor waits only when it needs the data,
one step later, so the transfer runs while the current block computes. With NCCL the
transfers run on NCCL's own streams and ``work.wait()`` makes the current CUDA stream wait for
them — the host never synchronises (no ``torch.cuda.synchronize``, ``.item()`` or ``.cpu()``
here). Received tensors are fresh, so the buffer being computed on and the one being filled
are always different (double buffering without a shared pool to get wrong).

Both sides of a message derive it from the same schedule in the same order, so every send
meets its receive within the same batch. The process group is always an argument, never a
module global. Notes (NCCL):

* as for any batched P2P, the group's communicator should already be initialised (any
  collective, or ``init_process_group(device_id=...)``) before the first batch;
* create the group with :func:`nccl_options` (high-priority streams), so that the transfer
  kernels' thread blocks are handed out ahead of a running attention kernel's waiting ones.
  That alone did not move the forward's first transfer in the 64K trace on 2 x H200 (it still
  began at the first block's last wave: cuDNN's forward holds every SM to its end); the
  executor's head start (``Engine._let_transfers_in``) did.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

#: Tensors of one message: tag * _PER_MESSAGE + index (gloo matches sends to receives by tag).
_PER_MESSAGE = 8

Spec = tuple[tuple[int, ...], torch.dtype]


def nccl_options(timeout: timedelta | None = None):
    """Options for the NCCL process group that carries the attention's transfers: its streams
    get high priority, so their thread blocks are dispatched ahead of queued compute blocks (a
    kernel that already holds every SM still needs the executor's head start).

    Args:
        timeout: the group's timeout, when ``init_process_group`` / ``new_group`` is given one
            too (the two must agree); None keeps NCCL's default.

    Returns:
        ``ProcessGroupNCCL.Options`` for ``init_process_group(pg_options=...)``,
        ``new_group(pg_options=...)`` or a DeviceMesh ``backend_override``; None when this
        torch build has no NCCL.
    """
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
    """Posts batches of point-to-point transfers inside one explicit process group.

    Args:
        group: the process group (ranks below are ranks IN this group); None for one rank,
            which never communicates.
    """

    def __init__(self, group):
        self.group = group
        self.rank = 0 if group is None else dist.get_rank(group)
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self._global = [0] if group is None else [dist.get_global_rank(group, r)
                                                  for r in range(self.world_size)]

    def post(self, sends: list[tuple[list[torch.Tensor], int, int]],
             recvs: list[tuple[list[Spec], int, int]], device: torch.device) -> Pending:
        """Post every send and receive of a batch at once; do not wait.

        Args:
            sends: ``(tensors, dst, tag)``, the tensors of one message (any layout).
            recvs: ``(specs, src, tag)``, specs ``[(shape, dtype), ...]`` of one message's
                tensors; fresh tensors are allocated for them.
            device: where received tensors live.

        Returns:
            A :class:`Pending` whose ``received`` lists follow the order of ``recvs``.

        A send and its receive carry the same tag (gloo matches on it; NCCL matches on order),
        and both sides must list the messages between any two ranks in the same order. Empty
        tensors travel as nothing (both sides know their shapes).
        """
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
