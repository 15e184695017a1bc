"""RMSNorm in one Triton kernel each way (transformers' ``LlamaRMSNorm`` arithmetic).

Each way reads its inputs once and writes its outputs once (eager RMSNorm makes about six passes
forward, twice that backward); the weight's gradient is summed in float32 per program, then over
programs. As transformers does, the normalised input is rounded to the input's dtype before the
weight multiplies it; the backward stays in float32."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lctrain_kernels.triton.common import DTYPE_KINDS, round_to

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


@torch.library.custom_op("lctrain::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (rows, hidden) in the dtype of ``weight * x``, rstd (rows,) float32) of x (rows,
    hidden) with a contiguous hidden dim."""
    rows, cols = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _rms_norm_fwd[(rows,)](x, weight, y, rstd, cols, x.stride(0), y.stride(0), float(eps),
                               X_KIND=DTYPE_KINDS[x.dtype], Y_KIND=DTYPE_KINDS[out_dtype],
                               BLOCK=triton.next_power_of_2(cols))
    return y, rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return (x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)),
            x.new_empty(x.shape[0], dtype=torch.float32))


@torch.library.custom_op("lctrain::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx like x, dweight in weight's dtype) from the gradient ``dy`` of y."""
    rows, cols = x.shape
    dx = torch.empty_like(x)
    programs = max(1, min(rows, _BWD_PROGRAMS))
    partial = torch.empty((programs, cols), dtype=torch.float32, device=x.device)
    if rows:
        _rms_norm_bwd[(programs,)](x, weight, dy, dx, rstd, partial, rows, cols, x.stride(0),
                                   dy.stride(0), dx.stride(0), triton.cdiv(rows, programs),
                                   X_KIND=DTYPE_KINDS[x.dtype], BLOCK=triton.next_power_of_2(cols))
    else:
        partial.zero_()
    return dx, partial.sum(0).to(weight.dtype)


@rms_norm_bwd.register_fake
def _(x, weight, rstd, dy):
    return torch.empty_like(x), torch.empty_like(weight)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, hidden) with the hidden dim contiguous (a copy only when it is not)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _rows(x)
        y, rstd = torch.ops.lctrain.rms_norm_fwd(x2, weight, float(eps))
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.lctrain.rms_norm_bwd(x2, weight, rstd, _rows(dy))
        return dx.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm of ``x`` (..., hidden) over its last dim with ``weight``
    (hidden,), in one kernel each way; CUDA tensors, or the CPU under ``TRITON_INTERPRET=1``."""
    return _RMSNorm.apply(x, weight, eps)
