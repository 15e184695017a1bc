"""Liger-Kernel's fused RMSNorm, SwiGLU, RoPE and loss in transformers models, from outside.

Liger-Kernel is the library of Triton kernels that most fine-tuning tools use; measured side by side
in whole training steps, it is as fast as the kernels lctrain carried, with a lower peak. The norm
and MLP modules of `lctrain.model.families` switch class in place to a subclass whose forward runs
the kernel (as FSDP2 does), so parameters, names and state dicts stay the same objects. `fuse_rope`
replaces each modeling module's global ``apply_rotary_pos_emb`` with one that runs the kernel on
CUDA tensors and transformers' own elsewhere."""
from __future__ import annotations

import functools
import importlib
from typing import Callable

import torch
from torch import nn

from lctrain.errors import ConfigError
from lctrain.model.families import class_names, family

NORM_CLASSES = class_names("RMSNorm")
"""RMSNorm classes computing ``weight * (x * rsqrt(mean(x²) + eps)).to(dtype)`` in float32."""
MLP_CLASSES = class_names("MLP")
"""Gated MLP classes computing ``down(act(gate(x)) * up(x))``; switched when act is a SiLU."""
SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})
_SUBCLASSES: dict[tuple[type, type], type] = {}


def liger():
    """Liger-Kernel's functional API, or one sentence saying how to install it."""
    try:
        from liger_kernel.transformers import functional
    except ImportError as error:
        raise ConfigError(f"model.fused_kernels needs Liger-Kernel, which cannot be imported "
                          f"({error}); pip install liger-kernel, or set model.fused_kernels: "
                          f"false", key="model.fused_kernels") from None
    return functional


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
    def forward(self, hidden_states):  # out of place: tiles and head groups reuse their gradients
        return liger().liger_rms_norm(hidden_states, self.weight, self.variance_epsilon,
                                      in_place=False)


class _FusedMLP:
    def forward(self, x):
        return self.down_proj(liger().liger_swiglu(self.gate_proj(x), self.up_proj(x)))


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every norm of ``model`` in :data:`NORM_CLASSES` the fused forward; returns how many."""
    liger()
    return switch_classes(model, _FusedNorm, lambda m: type(m).__name__ in NORM_CLASSES)


def fuse_mlps(model: nn.Module) -> int:
    """Give every MLP of ``model`` in :data:`MLP_CLASSES` with a SiLU activation the fused
    forward, in place; returns how many MLPs have it."""
    liger()
    return switch_classes(model, _FusedMLP, lambda m: type(m).__name__ in MLP_CLASSES
                          and type(getattr(m, "act_fn", None)).__name__ in SILU_CLASSES)


def fuse_rope(model_type: str) -> bool:
    """Make the modeling module of ``model_type`` apply RoPE through the kernel on CUDA tensors,
    once per process; False for a type whose formula is not transformers' Llama one."""
    if family(model_type) is None:
        return False
    rope = liger().liger_rope
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original = module.apply_rotary_pos_emb
    if getattr(original, "lctrain_fused", False):
        return True

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if q.is_cuda:
            return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.lctrain_fused = True
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def fused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                        labels: torch.Tensor) -> torch.Tensor:
    """Summed float32 token cross-entropy of ``hidden @ weight.T`` (labels shifted, -100 ignored)
    through Liger's fused linear cross-entropy: the logits never materialise, and the head's
    gradient sums in float32."""
    return liger().liger_fused_linear_cross_entropy(
        hidden.flatten(0, -2), weight, labels.flatten(), reduction="sum",
        accum_dtype=torch.float32).float()


def fuse_model(model: nn.Module) -> None:
    """Norms, MLPs and RoPE of ``model`` through Liger-Kernel."""
    fuse_rms_norms(model)
    fuse_rope(model.config.model_type)
    fuse_mlps(model)
