"""The gated MLP's SiLU product in one Triton kernel each way, for Llama-family models on GPUs.

transformers' MLP computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` as eager PyTorch:
the SiLU reads the gate and writes its result, the product reads that and the up projection
and writes again, and their backward makes three more passes, each over a (tokens,
intermediate) tensor, the widest in the layer. It also keeps the SiLU's output for the
product's backward, a third tensor of that size beside the gate and the up projection. Here
the forward reads the gate and the up projection once and writes the product once, keeping
only its two inputs, and the backward reads them and the product's gradient once and writes
both input gradients once, recomputing the SiLU.

Arithmetic is float32 and rounded once to the inputs' dtype (transformers rounds the SiLU's
output before the product, and the product's gradient before the SiLU's backward), so results
are at least as close to float64 math as transformers' own.

:func:`fuse_mlps` gives the MLP modules of a model this forward by switching each module's
class to a subclass (as FSDP2 does), so parameters, names, state dicts, tiling wrappers and
adapters on the projections see the same objects. Only the classes in :data:`FUSED_CLASSES`
whose activation is a SiLU are switched. The kernels run on CUDA tensors, and on the CPU under
``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from lctrain.model.class_switch import switch_classes
from lctrain.model.families import class_names
from lctrain.model.rounding import DTYPE_KINDS, round_to

FUSED_CLASSES = class_names("MLP")
"""transformers' gated MLP classes whose forward is ``down(act(gate(x)) * up(x))``; switched
when their ``act_fn`` is a SiLU."""

SILU_CLASSES = frozenset({"SiLU", "SiLUActivation"})
"""Activation classes that compute ``x * sigmoid(x)`` (torch's and transformers')."""

_BLOCK = 1024  # elements per program


@triton.jit
def _swiglu_fwd(G, U, H, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(G + offs, mask=live, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=live, other=0.0).to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    tl.store(H + offs, round_to(silu * u, KIND), mask=live)


@triton.jit
def _swiglu_bwd(G, U, DH, DG, DU, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(G + offs, mask=live, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=live, other=0.0).to(tl.float32)
    dh = tl.load(DH + offs, mask=live, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(DU + offs, round_to(dh * g * sig, KIND), mask=live)
    tl.store(DG + offs, round_to(dh * u * sig * (1.0 + g * (1.0 - sig)), KIND), mask=live)


def _launch(kernel, *tensors: torch.Tensor) -> None:
    n = tensors[0].numel()
    if n:
        kernel[(triton.cdiv(n, _BLOCK),)](*tensors, n, KIND=DTYPE_KINDS[tensors[0].dtype],
                                          BLOCK=_BLOCK)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        _launch(_swiglu_fwd, gate, up, h)
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _launch(_swiglu_bwd, gate, up, dh.contiguous(), dgate, dup)
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel each way (float32 arithmetic, rounded once)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu needs gate and up of one shape and dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    return _SwiGLU.apply(gate, up)


class _FusedForward:
    """Mixed into a switched MLP's class: the forward through :func:`swiglu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def fusable(module: nn.Module) -> bool:
    """Whether ``module`` is one of :data:`FUSED_CLASSES` with a SiLU activation."""
    return (type(module).__name__ in FUSED_CLASSES
            and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES)


def fuse_mlps(model: nn.Module) -> int:
    """Switch every MLP module of ``model`` that :func:`fusable` accepts to the fused forward, in
    place; returns how many MLPs of ``model`` have it."""
    return switch_classes(model, _FusedForward, fusable)
