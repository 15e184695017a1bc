"""AdamW whose moments live in pinned host memory (``train.offload: optimizer``), streamed
through the GPU in chunks at each step while parameters and gradients stay on the GPU."""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw

from lctrain.parallel.offload import PinnedPool

CHUNK_BYTES = 256 << 20
"""Bytes of state (both moments) streamed per chunk (at most three chunks on the GPU)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class HostAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` with its moments in pinned host memory, ``chunk_bytes`` at a time."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=True)
        self.chunk_bytes = chunk_bytes
        self.pool = PinnedPool()
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None  # in, out
        self._done = None  # event of the last copy back to the host
        self.register_load_state_dict_post_hook(lambda opt: opt.park())

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step, the states streamed through the GPU chunk by chunk."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the loop's non-finite flag, as fused AdamW takes it: skip the whole step. torch's
        # foreach update takes no such flag, so it is read on the host (one sync per step).
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf.item()):
            return loss
        work = [(group, chunk) for group in self.param_groups
                for chunk in self._chunks([p for p in group["params"] if p.grad is not None])]
        coming = self._bring(work[0][1]) if work else None
        for i, (group, chunk) in enumerate(work):
            hosts, moments, arrived = coming
            coming = self._bring(work[i + 1][1]) if i + 1 < len(work) else None
            if arrived is not None:  # this chunk's states are on the GPU
                torch.cuda.current_stream(moments[0].device).wait_event(arrived)
            beta1, beta2 = group["betas"]
            adamw([_local(p) for p in chunk], [_local(p.grad) for p in chunk], moments[0::2],
                  moments[1::2], [], [self.state[p]["step"] for p in chunk], foreach=True,
                  capturable=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            self._send_back(hosts, moments)
        return loss

    def _chunks(self, params: list[torch.Tensor]):
        chunk, size = [], 0
        for p in params:
            nbytes = 2 * _local(p).numel() * 4
            if chunk and size + nbytes > self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += nbytes
        if chunk:
            yield chunk

    def _state(self, p: torch.Tensor) -> dict:
        """The parameter's state, created on first use: zero moments on the host."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = self._host_like(p)
            state["exp_avg_sq"] = self._host_like(p)
        return state

    def _host_like(self, p: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        """A host tensor like ``p`` (pinned on GPUs), zeros or a copy of ``value``."""
        local = _local(p)
        if local.is_cuda:
            raw = self.pool.take(local.numel() * local.element_size())
            host = raw.view(local.dtype).view(local.shape)
        else:
            host = torch.empty(local.shape, dtype=local.dtype)
        if value is None:
            host.zero_()
        else:
            host.copy_(_local(value))
        if hasattr(p, "_local_tensor"):
            from torch.distributed.tensor import DTensor

            # not DTensor.from_local: it moves a host tensor to the mesh's device, which put
            # every state back on the GPU. The constructor keeps it where it is, as FSDP2's own
            # CPU offload does.
            return DTensor(host, p._spec, requires_grad=False)
        return host

    def _bring(self, chunk: list[torch.Tensor]):
        """(host states, their device copies, the arrival event) of a chunk."""
        hosts = [_local(self._state(p)[k]) for p in chunk for k in ("exp_avg", "exp_avg_sq")]
        device = _local(chunk[0]).device
        if device.type != "cuda":
            return hosts, hosts, None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        incoming, _ = self._streams
        if self._done is not None:  # last step's copies of these buffers went out first
            incoming.wait_event(self._done)
        with torch.cuda.stream(incoming):
            moved = [h.to(device, non_blocking=True) for h in hosts]
        for m in moved:
            m.record_stream(torch.cuda.current_stream(device))
        return hosts, moved, incoming.record_event()

    def _send_back(self, hosts: list[torch.Tensor], moments: list[torch.Tensor]) -> None:
        if moments[0].device.type != "cuda":
            return
        _, outgoing = self._streams
        outgoing.wait_stream(torch.cuda.current_stream(moments[0].device))
        with torch.cuda.stream(outgoing):
            for h, m in zip(hosts, moments):
                h.copy_(m, non_blocking=True)
                m.record_stream(outgoing)
        self._done = outgoing.record_event()

    def synchronize(self) -> None:
        """Wait until the host holds the latest states (before reading them on the host)."""
        if self._done is not None:
            self._done.synchronize()

    def state_dict(self) -> dict:
        self.synchronize()
        return super().state_dict()

    def park(self) -> None:
        """Move states a load put on the GPU back to host memory."""
        for p, state in self.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                value = state.get(key)
                if value is not None and _local(value).device.type != "cpu":
                    state[key] = self._host_like(p, value)
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].float().cpu()
