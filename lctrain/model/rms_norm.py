"""RMSNorm in one Triton kernel each way, for the norms of Llama-family models on GPUs.

transformers' RMSNorm runs as eager PyTorch: a float32 copy of the input, its square, the
mean, the scaling, the cast back and the weight's product, each one kernel reading and
writing the whole (tokens, hidden) tensor, and about twice that again in the backward. On
long sequences these passes over memory take a visible share of a training step (`lctrain
bench step --profile` lists them under "other"). Here the forward reads the input once and
writes the output once (plus one float32 scale per token, kept for the backward), and the
backward reads the input and the output's gradient once and writes the input's gradient once,
with the weight's gradient summed in float32 per program and then over programs.

The arithmetic is transformers' ``LlamaRMSNorm``: the normalized input is rounded to the
input's dtype before the weight multiplies it, and the output has the dtype that
``weight * normalized`` has in PyTorch. The backward keeps float32 throughout (transformers
rounds ``grad * weight`` to the compute dtype first), so gradients are at least as close to
float64 math as transformers' own.

:func:`fuse_rms_norms` gives the norm modules of a model this forward by switching each
module's class to a subclass (as FSDP2 does), so parameters, names, state dicts, tiling
wrappers and adapters see the same objects. Only the classes in :data:`FUSED_CLASSES`, whose
forward is exactly that arithmetic, are switched. The kernels run on CUDA tensors, and on the
CPU under ``TRITON_INTERPRET=1`` (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from lctrain.model.class_switch import switch_classes
from lctrain.model.families import class_names
from lctrain.model.rounding import DTYPE_KINDS, round_to

FUSED_CLASSES = class_names("RMSNorm")
"""transformers' RMSNorm classes that compute ``weight * (x * rsqrt(mean(x²) + eps)).to(dtype)``
in float32 (Gemma's, which scales by ``1 + weight``, is not one of them)."""

_BWD_PROGRAMS = 512  # programs of the backward: each sums the weight gradient of its rows


@triton.jit
def _rms_norm_fwd(X, W, Y, Rstd, n_cols, stride_x, stride_y, eps, X_KIND: tl.constexpr,
                  Y_KIND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / n_cols + eps))  # IEEE, not approx.
    normed = round_to(x * rstd, X_KIND)
    w = tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, round_to(normed * w, Y_KIND), mask=live)
    tl.store(Rstd + row, rstd)


@triton.jit
def _rms_norm_bwd(X, W, DY, DX, Rstd, DW, n_rows, n_cols, stride_x, stride_dy, stride_dx,
                  rows_per_program, X_KIND: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    w = tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = (first + i).to(tl.int64)
        if row < n_rows:
            x = tl.load(X + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=live, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + row)
            xhat = x * rstd
            dw += dy * round_to(xhat, X_KIND)
            dn = dy * w
            dx = rstd * (dn - xhat * (tl.sum(dn * xhat, axis=0) / n_cols))
            tl.store(DX + row * stride_dx + cols, round_to(dx, X_KIND), mask=live)
    tl.store(DW + pid * n_cols + cols, dw, mask=live)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, hidden) with the hidden dim contiguous (a copy only when it is not)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _rows(x)
        rows, cols = x2.shape
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            _rms_norm_fwd[(rows,)](x2, weight, y, rstd, cols, x2.stride(0), y.stride(0),
                                   float(eps), X_KIND=DTYPE_KINDS[x.dtype],
                                   Y_KIND=DTYPE_KINDS[out_dtype],
                                   BLOCK=triton.next_power_of_2(cols))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = _rows(dy)
        dx = torch.empty_like(x2)
        programs = max(1, min(rows, _BWD_PROGRAMS))
        partial = torch.empty((programs, cols), dtype=torch.float32, device=x2.device)
        if rows:
            _rms_norm_bwd[(programs,)](x2, weight, dy2, dx, rstd, partial, rows, cols,
                                       x2.stride(0), dy2.stride(0), dx.stride(0),
                                       triton.cdiv(rows, programs), X_KIND=DTYPE_KINDS[x2.dtype],
                                       BLOCK=triton.next_power_of_2(cols))
        else:
            partial.zero_()
        return dx.view(ctx.shape), partial.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm of ``x`` over its last dim, in one kernel each way."""
    return _RMSNorm.apply(x, weight, eps)


class _FusedForward:
    """Mixed into a switched norm module's class: the forward through :func:`rms_norm`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def fuse_rms_norms(model: nn.Module) -> int:
    """Switch every norm module of ``model`` whose class is in :data:`FUSED_CLASSES` to the
    fused forward, in place; returns how many norms of ``model`` have it."""
    return switch_classes(model, _FusedForward, lambda m: type(m).__name__ in FUSED_CLASSES)
