"""Parking what a checkpointed layer keeps (its input; under remat the attention's out, lse) in
pinned host memory until its backward: copied out when saved, brought back when the layer
above recomputes (on a GPU on a side stream into exact-size buffers; else plain copies)."""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class PinnedPool:
    """Page-locked host buffers of exactly the requested size, reused from step to step."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._all: list[torch.Tensor] = []
        self.pinned_bytes = 0
        weakref.finalize(self, _unregister, self._all)

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 host tensor of ``nbytes`` bytes."""
        bucket = self._free.get(nbytes)
        if bucket:
            return bucket.pop()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB of host memory "
                               f"failed (CUDA error {int(err)}); parked layers need that much "
                               f"page-locked memory: lower data.seq_len or park fewer layers "
                               f"(train.offload).")
        self._all.append(buf)
        self.pinned_bytes += nbytes
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free.setdefault(buf.numel(), []).append(buf)


def _unregister(buffers: list[torch.Tensor]) -> None:
    """Unpin the pool's buffers before their memory goes back to the host allocator."""
    for buf in buffers:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    buffers.clear()


def _span(shape, stride) -> int:
    """Elements a strided view reaches (the storage it needs)."""
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 0


class _Copy:
    """One tensor's bytes parked in host memory, and the way back."""

    def __init__(self, tensor: torch.Tensor, stream, *, release: bool,
                 pool: PinnedPool | None = None) -> None:
        self.device = tensor.device
        self.storage = tensor.untyped_storage() if release else None
        self.shape, self.stride, self.dtype = tensor.shape, tensor.stride(), tensor.dtype
        source = _bytes_view(tensor.untyped_storage(), self.device) if release else tensor
        pinned = stream is not None
        if pinned:  # exact-size page-locked buffer, returned to the pool with this copy
            nbytes = _span(source.shape, source.stride()) * source.element_size()
            raw = pool.take(nbytes)
            weakref.finalize(self, pool.give, raw)
            self.host = raw.view(source.dtype).as_strided(source.shape, source.stride())
        else:
            self.host = torch.empty_strided(source.shape, source.stride(), dtype=source.dtype,
                                            device="cpu")
        with _on(stream):
            self.host.copy_(source, non_blocking=pinned)
        if pinned:
            source.record_stream(stream)
        if release:
            self.storage.resize_(0)  # the GPU block is freed once the copy has finished
        self.back: torch.Tensor | None = None

    def fetch(self, stream) -> None:
        """Start the copy back (into the original storage when it was released)."""
        if self.storage is not None:
            self.storage.resize_(self.host.numel())
            target = _bytes_view(self.storage, self.device)
        else:
            target = torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                         device=self.device)
        with _on(stream):
            target.copy_(self.host, non_blocking=stream is not None)
        if stream is not None:
            target.record_stream(stream)
        self.back = target


class LayerStash:
    """What one call of one checkpointed layer parked in host memory."""

    def __init__(self, offloader: Offloader, previous) -> None:
        self.offloader = offloader
        self.previous = previous  # () -> the stash made before this one (a weak reference)
        self.inputs: list[_Copy] = []
        self.outputs: list[torch.Tensor] = []  # recorded op outputs, moved out at forward end
        self.parked: list[_Copy] = []
        self.ready = None  # once fetched: (event, device) on a GPU, True off one

    def pack(self, tensor: torch.Tensor):
        """saved_tensors_hooks pack: park the layer input (small tensors stay)."""
        if not self.offloader.wants(tensor):
            return tensor
        copy = _Copy(tensor, self.offloader.stream_for_device(tensor.device), release=False,
                     pool=self.offloader.pool)
        self.inputs.append(copy)
        return copy

    def unpack(self, packed) -> torch.Tensor:
        """saved_tensors_hooks unpack: the recompute of this layer starts now."""
        if isinstance(packed, torch.Tensor):
            return packed
        self.wait()
        previous = self.previous()
        if previous is not None and previous is not self:  # the layer below, to recompute next
            previous.fetch()
        if packed.back is None:  # a second backward through a retained graph
            packed.fetch(None)
        tensor, packed.back = packed.back, None  # the stash forgets it
        return tensor

    def record(self, outputs) -> None:
        for tensor in outputs if isinstance(outputs, (tuple, list)) else (outputs,):
            if isinstance(tensor, torch.Tensor) and self.offloader.wants(tensor, whole=True):
                self.outputs.append(tensor)

    def park_outputs(self) -> None:
        """End of the layer's forward: move the recorded attention outputs out."""
        # one copy per storage: each recorded tensor spans all of its storage
        for tensor in {t.untyped_storage().data_ptr(): t for t in self.outputs}.values():
            self.parked.append(_Copy(tensor, self.offloader.stream_for_device(tensor.device),
                                     release=True, pool=self.offloader.pool))
        self.outputs = []
        self.ready = None

    def fetch(self) -> None:
        """Start bringing everything back (idempotent until the next forward)."""
        if self.ready is not None:
            return
        copies = self.inputs + self.parked
        stream = self.offloader.stream_for_device(copies[0].device) if copies else None
        for copy in copies:
            copy.fetch(stream)
        self.ready = (stream.record_event(), copies[0].device) if stream is not None else True

    def wait(self) -> None:
        """Make the current stream wait for this stash's copies back (starting them if needed)."""
        self.fetch()
        if self.ready is not True:
            event, device = self.ready
            torch.cuda.current_stream(device).wait_event(event)
        self.parked = []  # refilled storages belong to the cache again


class _RecordOutputs(TorchDispatchMode):
    """Records the outputs of the ops selective checkpointing must save (what its cache keeps)."""

    def __init__(self, stash: LayerStash, saved) -> None:
        super().__init__()
        self.stash, self.saved = stash, saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.saved(func):
            self.stash.record(out)
        return out


class Offloader:
    """One `LayerStash` per parked layer call, and the copy stream (tensors < ``min_bytes`` stay)."""

    def __init__(self, min_bytes: int = 1 << 20) -> None:
        self.min_bytes = min_bytes
        self.pool = PinnedPool()  # used on GPUs only
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last = lambda: None  # a weak reference to the newest stash

    def wants(self, tensor: torch.Tensor, *, whole: bool = False) -> bool:
        """Whether to park ``tensor``; ``whole``: only if it is its storage's only view."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < max(self.min_bytes, 1):
            return False
        return not whole or (tensor.storage_offset() == 0
                             and tensor.untyped_storage().nbytes() == nbytes)

    def stream_for_device(self, device: torch.device):
        """The side stream for copies to/from ``device`` (None off a GPU)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def new_stash(self) -> LayerStash:
        stash = LayerStash(self, self._last)
        self._last = weakref.ref(stash)
        return stash

    def contexts(self, stash: LayerStash, make_contexts, saved):
        """(forward, recompute) contexts: checkpointing's own, parking ``saved`` ops' outputs."""
        forward_mode, recompute_mode = make_contexts()
        return _forward_context(stash, forward_mode, saved), _after(stash.wait, recompute_mode)

    def prefetching_contexts(self, make_contexts):
        """Contexts of a GPU-kept layer whose recompute starts the newest stash's copies back."""
        forward_mode, recompute_mode = make_contexts()
        return forward_mode, _after(self.prefetch_newest, recompute_mode)

    def prefetch_newest(self) -> None:
        """Start the copies back of the most recently created stash (idempotent)."""
        newest = self._last()
        if newest is not None:
            newest.fetch()


@contextlib.contextmanager
def _forward_context(stash: LayerStash, forward_mode, saved):
    recording = _RecordOutputs(stash, saved) if saved is not None else contextlib.nullcontext()
    with forward_mode, recording:  # nothing to record (full): no mode in every op's way
        yield
    stash.park_outputs()


@contextlib.contextmanager
def _after(first, recompute_mode):
    first()
    with recompute_mode:
        yield


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage`` (its own version counter)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def host_memory_bytes(module: torch.nn.Module, optimizer=None) -> int:
    """Host bytes this process keeps for training (pinned pools, host-resident state)."""
    pools = {id(arg.pool): arg.pool for m in module.modules()
             for arg in getattr(getattr(m, "checkpoint_fn", None), "args", ())
             if isinstance(arg, Offloader)}
    if isinstance(getattr(optimizer, "pool", None), PinnedPool):
        pools[id(optimizer.pool)] = optimizer.pool
    pooled = {buf.data_ptr() for pool in pools.values() for buf in pool._all}
    tensors = [*module.parameters(), *(p.grad for p in module.parameters() if p.grad is not None)]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0]
    total = sum(pool.pinned_bytes for pool in pools.values())
    for t in tensors:  # each host storage once, the pools' counted above
        local = getattr(t, "_local_tensor", t)
        key = local.untyped_storage().data_ptr()
        if local.device.type == "cpu" and key not in pooled:
            pooled.add(key)
            total += local.untyped_storage().nbytes()
    return total
