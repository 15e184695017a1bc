"""The gated MLP's ``silu(gate) * up`` in one Triton kernel each way, keeping only gate and up
(eager PyTorch also keeps the SiLU's output, a third tensor of the layer's widest size); the
backward recomputes the SiLU. float32 arithmetic rounded once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lctrain_kernels.triton.common import DTYPE_KINDS, round_to

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


@torch.library.custom_op("lctrain::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two contiguous tensors of one shape and dtype."""
    h = torch.empty_like(gate)
    _launch(_swiglu_fwd, gate, up, h)
    return h


@swiglu_fwd.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("lctrain::swiglu_bwd", mutates_args=())
def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) from the contiguous gradient ``dh`` of the product."""
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    _launch(_swiglu_bwd, gate, up, dh, dgate, dup)
    return dgate, dup


@swiglu_bwd.register_fake
def _(gate, up, dh):
    return torch.empty_like(gate), torch.empty_like(up)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return torch.ops.lctrain.swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        return torch.ops.lctrain.swiglu_bwd(gate, up, dh.contiguous())


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel each way, for two tensors of one shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu needs gate and up of one shape and dtype, got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}")
    return _SwiGLU.apply(gate, up)
