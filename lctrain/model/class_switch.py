"""Give chosen modules of a model another forward by switching their class in place.

FSDP2 does the same to the modules it shards: each chosen module's class becomes a subclass
of its own with a mixin first, so its parameters, buffers, names, state dict, hooks and
whatever wraps it (tiling, checkpointing, adapters) see the same object, now with the mixin's
methods. The fused norms and MLPs (`lctrain.model.rms_norm`, `lctrain.model.swiglu`) are
applied this way.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

_SUBCLASSES: dict[tuple[type, type], type] = {}


def switch_classes(model: nn.Module, mixin: type, accept: Callable[[nn.Module], bool]) -> int:
    """Switch every module of ``model`` that ``accept`` takes to ``Fused<its class>``, a subclass
    with ``mixin`` first, in place; returns how many modules of ``model`` have the mixin
    (switched now or before)."""
    count = 0
    for module in model.modules():
        cls = type(module)
        if issubclass(cls, mixin):  # switched before
            count += 1
            continue
        if not accept(module):
            continue
        key = (mixin, cls)
        if key not in _SUBCLASSES:
            _SUBCLASSES[key] = type(f"Fused{cls.__name__}", (mixin, cls), {})
        module.__class__ = _SUBCLASSES[key]
        count += 1
    return count
