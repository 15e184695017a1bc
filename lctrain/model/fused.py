"""lctrain_kernels' fused RMSNorm, SwiGLU and RoPE in transformers models, from outside.

The norm and MLP modules of `lctrain.model.families` switch class in place to a subclass whose
forward runs the kernel (as FSDP2 does), so parameters, names and state dicts stay the same objects.
`fuse_rope` replaces each modeling module's global ``apply_rotary_pos_emb`` with a function that
runs the kernel for the calls it supports and transformers' own for any other."""
from __future__ import annotations

import functools
import importlib
from typing import Callable

from torch import nn

from lctrain.model.families import class_names, family
from lctrain_kernels.api import rms_norm, rope, rope_supports, swiglu

NORM_CLASSES = class_names("RMSNorm")
"""RMSNorm classes computing ``weight * (x * rsqrt(mean(x²) + eps)).to(dtype)`` in float32."""
MLP_CLASSES = class_names("MLP")
"""Gated MLP classes computing ``down(act(gate(x)) * up(x))``; switched when act is a SiLU."""
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})
_SUBCLASSES: dict[tuple[type, type], type] = {}


def switch_classes(model: nn.Module, mixin: type, accept: Callable[[nn.Module], bool]) -> int:
    """Switch every module of ``model`` that ``accept`` takes to ``Fused<its class>``, a subclass
    with ``mixin`` first, in place; returns how many modules have the mixin (now or before)."""
    count = 0
    for module in model.modules():
        cls = type(module)
        if not issubclass(cls, mixin) and accept(module):  # else: switched before, or not taken
            key = (mixin, cls)
            if key not in _SUBCLASSES:
                _SUBCLASSES[key] = type(f"Fused{cls.__name__}", (mixin, cls), {})
            module.__class__ = _SUBCLASSES[key]
        count += isinstance(module, mixin)
    return count


class _FusedNorm:
    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _FusedMLP:
    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every norm of ``model`` in :data:`NORM_CLASSES` the fused forward; returns how many."""
    return switch_classes(model, _FusedNorm, lambda m: type(m).__name__ in NORM_CLASSES)


def fuse_mlps(model: nn.Module) -> int:
    """Give every MLP of ``model`` in :data:`MLP_CLASSES` with a SiLU activation the fused
    forward, in place; returns how many MLPs have it."""
    return switch_classes(model, _FusedMLP, lambda m: type(m).__name__ in MLP_CLASSES
                          and type(getattr(m, "act_fn", None)).__name__ in SILU_CLASSES)


def fuse_rope(model_type: str) -> bool:
    """Make the modeling module of ``model_type`` apply RoPE through the kernel (where
    `lctrain_kernels.api.rope_supports` the call), once per process; False for a type whose
    formula is not transformers' Llama one."""
    if not getattr(family(model_type), "fused", False):
        return False
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original = module.apply_rotary_pos_emb
    if getattr(original, "lctrain_fused", False):
        return True

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if rope_supports(q, k, cos, sin, unsqueeze_dim):
            return rope(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.lctrain_fused = True
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True
