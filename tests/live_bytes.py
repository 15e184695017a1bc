"""Peak bytes of live tensor storage on a CPU, measured without a GPU allocator.

``with LiveBytes() as live: ...`` sees every tensor an op creates while it is active (forward
and backward: the autograd engine runs CPU backward ops on the calling thread with the mode
on), tracks each new storage until it is freed (storages keep their Python object alive as
long as the memory lives, so a finalizer fires exactly when it is released) and keeps the
largest total. Storages that existed before the block (parameters, inputs) are not counted.
`SavedBytes` measures instead what one module saves for the backward.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):  # new storages only: not views of, or writes into, inputs
            if (isinstance(t, torch.Tensor) and t.device.type == "cpu"
                    and t.untyped_storage().data_ptr() not in inputs):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live


class SavedBytes:
    """Bytes of the distinct non-parameter storages saved for backward inside one module: pass
    `pack` to ``torch.autograd.graph.saved_tensors_hooks`` and read `total` after the forward."""

    def __init__(self, model, module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.active, self.storages = False, {}
        module.register_forward_pre_hook(lambda *a: setattr(self, "active", True))
        module.register_forward_hook(lambda *a: setattr(self, "active", False))

    def pack(self, t):
        storage = t.untyped_storage()
        if self.active and storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self):
        return sum(self.storages.values())
