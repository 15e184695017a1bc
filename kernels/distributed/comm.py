"""Point-to-point exchange of one schedule step, posted as one batch and waited on later.

Each message of a step (k and v of a rank, a run of query rows, a partial result, gradients)
travels as ONE contiguous byte buffer: its tensors are packed back to back, every piece
aligned to 16 bytes, so K and V (or out and its float32 lse) cost one send, not two, and
gloo's need for contiguous tensors is met. The receiver unpacks with zero-copy views.

:class:`Exchanger` posts all sends and receives of a step with ``dist.batch_isend_irecv`` and
returns a :class:`Pending` without waiting. The executor waits only when it needs the data,
one step later, so the transfer runs while the current block computes. With NCCL the
transfers run on NCCL's own streams and ``work.wait()`` makes the current CUDA stream wait for
them — the host never synchronises (no ``torch.cuda.synchronize``, ``.item()`` or ``.cpu()``
here). Received buffers are fresh tensors, so the buffer being computed on and the one being
filled are always different (double buffering without a shared pool to get wrong).

Both sides of a message derive it from the same schedule in the same order, so every send
meets its receive within the same batch. The process group is always an argument, never a
module global. Note (NCCL): as for any batched P2P, the group's communicator should already be
initialised (any collective, or ``init_process_group(device_id=...)``) before the first batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_ALIGN = 16


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def packed_size(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of the buffer holding tensors of ``specs`` = [(shape, dtype), ...]."""
    return sum(_aligned(_nbytes(shape, dtype)) for shape, dtype in specs)


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` (any layout) into one contiguous uint8 buffer, 16-byte aligned pieces.

    Returns:
        A 1-D uint8 tensor on the tensors' device.
    """
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    buf = torch.empty(packed_size(specs), dtype=torch.uint8, device=tensors[0].device)  # (bytes,)
    for t, view in zip(tensors, unpack(buf, specs)):
        view.copy_(t)
    return buf


def unpack(buf: torch.Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Views of the tensors packed in ``buf`` (no copy), in order.

    Raises:
        ValueError: if ``buf`` is smaller than ``specs`` need.
    """
    if buf.numel() < packed_size(specs):
        raise ValueError(f"buffer of {buf.numel()} bytes cannot hold {packed_size(specs)} bytes")
    views, offset = [], 0
    for shape, dtype in specs:
        n = _nbytes(shape, dtype)
        views.append(buf[offset:offset + n].view(dtype).view(shape))
        offset += _aligned(n)
    return views


@dataclass
class Pending:
    """Posted transfers of one batch; :meth:`wait` before touching the received buffers."""

    works: list = field(default_factory=list)
    received: list[torch.Tensor] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)  # kept alive until waited

    def wait(self) -> list[torch.Tensor]:
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

    def post(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[int, int, int]],
             device: torch.device) -> Pending:
        """Post every send and receive of a batch at once; do not wait.

        Args:
            sends: ``(buffer, dst, tag)``, buffers 1-D contiguous uint8 (see :func:`pack`).
            recvs: ``(nbytes, src, tag)``; a fresh buffer is allocated for each.
            device: where receive buffers live.

        Returns:
            A :class:`Pending` whose ``received`` buffers follow the order of ``recvs``.

        A send and its receive carry the same tag (gloo matches on it; NCCL matches on order),
        and both sides must list the messages between any two ranks in the same order.
        """
        pending = Pending(received=[torch.empty(n, dtype=torch.uint8, device=device)
                                    for n, _, _ in recvs])
        ops = [dist.P2POp(dist.isend, buf, self._global[dst], self.group, tag=tag)
               for buf, dst, tag in sends]
        ops += [dist.P2POp(dist.irecv, buf, self._global[src], self.group, tag=tag)
                for buf, (_, src, tag) in zip(pending.received, recvs)]
        if ops:
            pending.works = list(dist.batch_isend_irecv(ops))
            pending.sent = [buf for buf, _, _ in sends]
        return pending
