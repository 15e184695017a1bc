"""Rotary position embedding of q and k in one Triton kernel each way, for Llama-family models.

transformers applies RoPE as ``q * cos + rotate_half(q) * sin`` (and the same for k) in eager
PyTorch on (B, H, S, D) views of (B, S, H, D) projections: a concatenation, a negation, two
products and a sum per tensor, each a kernel over a strided tensor, again in the recompute of
a checkpointed layer and about twice that in the backward (`lctrain bench step --profile`
lists them under "other"). Here one kernel reads q, k, cos and sin once and writes both
results once, and the backward does the same with the gradients. The results are contiguous
(B, S, H, D) tensors returned as (B, H, S, D) views, the layout the attention reads.

Arithmetic: transformers' formula in float32, rounded once to the inputs' dtype (transformers
rounds after each product and the sum), and the backward in float32 (the rotation's transpose:
``dq = dout * cos + rotate_half⁻¹(dout * sin)``). cos and sin get no gradient (they come from
positions).

transformers calls ``apply_rotary_pos_emb`` as a global of each model's modeling module, so
:func:`fuse_rope` replaces that global in the modules of the fused families (`lctrain.model.families`) with a function
that runs the kernel for the calls it is made for (4-dim CUDA q and k, 3-dim cos and sin, the
default ``unsqueeze_dim``) and transformers' own function for any other call. The kernels run
on CUDA tensors, and on the CPU under ``TRITON_INTERPRET=1`` (tests, which put the global back).
"""
from __future__ import annotations

import functools
import importlib

import torch
import triton
import triton.language as tl

from lctrain.model.families import family
from lctrain.model.rounding import DTYPE_KINDS, round_to
from lctrain_kernels.triton.common import interpreting



@triton.jit
def _rope_kernel(Q, K, OQ, OK, Cos, Sin, S, Hq, Hk, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h,
                 sc_b, sc_s, KIND: tl.constexpr, BACKWARD: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    """One token of one row: q's and k's heads rotated, or with BACKWARD by the rotation's
    transpose. With x = (x1, x2) halves, forward: (x1·c1 − x2·s1, x2·c2 + x1·s2); transpose:
    (x1·c1 + x2·s2, x2·c2 − x1·s1). Outputs are contiguous (B, S, H, D)."""
    token = tl.program_id(0).to(tl.int64)
    b = token // S
    s = token % S
    d = tl.arange(0, HALF)
    c1 = tl.load(Cos + b * sc_b + s * sc_s + d).to(tl.float32)
    c2 = tl.load(Cos + b * sc_b + s * sc_s + HALF + d).to(tl.float32)
    s1 = tl.load(Sin + b * sc_b + s * sc_s + d).to(tl.float32)
    s2 = tl.load(Sin + b * sc_b + s * sc_s + HALF + d).to(tl.float32)
    if BACKWARD:  # the coefficient of x2 in the first half and of x1 in the second
        a, e = s2, -s1
    else:
        a, e = -s1, s2
    _rotate_heads(Q, OQ, token, b * sq_b + s * sq_s, sq_h, Hq, c1, c2, a, e, KIND, HALF, BLOCK_H)
    _rotate_heads(K, OK, token, b * sk_b + s * sk_s, sk_h, Hk, c1, c2, a, e, KIND, HALF, BLOCK_H)


@triton.jit
def _rotate_heads(X, OUT, token, row, stride_h, H, c1, c2, a, e, KIND: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """The H heads of one token of X (at element ``row``) into contiguous OUT, BLOCK_H at a
    time: (x1·c1 + x2·a, x2·c2 + x1·e)."""
    d = tl.arange(0, HALF)
    heads = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + heads
        live = (h < H)[:, None]
        src = X + row + h[:, None] * stride_h + d[None, :]
        x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
        dst = OUT + (token * H + h[:, None]) * (2 * HALF) + d[None, :]
        tl.store(dst, round_to(x1 * c1[None, :] + x2 * a[None, :], KIND), mask=live)
        tl.store(dst + HALF, round_to(x2 * c2[None, :] + x1 * e[None, :], KIND), mask=live)


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, S, D) and k (B, Hk, S, D), each with D contiguous, rotated by cos/sin (B, S, D)
    (``backward``: by the transpose); results as (B, H, S, D) views of contiguous (B, S, H, D)."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    oq = torch.empty((b, s, hq, d), dtype=q.dtype, device=q.device)
    ok = torch.empty((b, s, hk, d), dtype=k.dtype, device=k.device)
    if b * s:
        _rope_kernel[(b * s,)](
            q, k, oq, ok, cos, sin, s, hq, hk, q.stride(0), q.stride(2), q.stride(1),
            k.stride(0), k.stride(2), k.stride(1), cos.stride(0), cos.stride(1),
            KIND=DTYPE_KINDS[q.dtype], BACKWARD=backward, HALF=d // 2,
            BLOCK_H=min(16, triton.next_power_of_2(max(hq, hk))))
    return oq.transpose(1, 2), ok.transpose(1, 2)


def rotate_tokens(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on token-major q (B, S, Hq, D) and k (B, S, Hk, D), D contiguous, with cos/sin
    (B, S, D) of any float dtype (read in float32); ``backward``: by the rotation's transpose.
    Returns contiguous (B, S, H, D) tensors in q's and k's dtypes."""
    oq, ok = _rotate(q.transpose(1, 2), k.transpose(1, 2), _last_dim_contiguous(cos),
                     _last_dim_contiguous(sin), backward)
    return oq.transpose(1, 2), ok.transpose(1, 2)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = _last_dim_contiguous(cos), _last_dim_contiguous(sin)
        ctx.save_for_backward(cos, sin)
        ctx.shapes = (q.shape, k.shape)
        return _rotate(_last_dim_contiguous(q), _last_dim_contiguous(k), cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        dq = torch.zeros(q_shape, dtype=cos.dtype, device=cos.device) if dq is None else dq
        dk = torch.zeros(k_shape, dtype=cos.dtype, device=cos.device) if dk is None else dk
        gq, gk = _rotate(_last_dim_contiguous(dq), _last_dim_contiguous(dk), cos, sin, True)
        return gq, gk, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` in one kernel each way.

    Args:
        q: (B, Hq, S, D) queries; k: (B, Hk, S, D) keys; same dtype (fp32, fp16, bf16), D even.
        cos, sin: (B, S, D) in the same dtype, halves repeated as transformers builds them.
    """
    return _Rope.apply(q, k, cos, sin)


def supports(q, k, cos, sin, unsqueeze_dim: int = 1) -> bool:
    """Whether :func:`rope` computes this call of ``apply_rotary_pos_emb``."""
    return (unsqueeze_dim == 1 and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3
            and sin.shape == cos.shape and q.dtype in DTYPE_KINDS and k.dtype == q.dtype
            and cos.dtype == q.dtype and sin.dtype == q.dtype
            and q.shape[-1] == k.shape[-1] == cos.shape[-1] and q.shape[-1] % 2 == 0
            and q.shape[0] == k.shape[0] == cos.shape[0]
            and q.shape[2] == k.shape[2] == cos.shape[1]
            and triton.next_power_of_2(q.shape[-1] // 2) == q.shape[-1] // 2)


def _fused(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (q.is_cuda or interpreting()) and supports(q, k, cos, sin, unsqueeze_dim):
            return rope(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.lctrain_fused = True
    return apply_rotary_pos_emb


def fuse_rope(model_type: str) -> bool:
    """Make the modeling module of ``model_type`` apply RoPE through :func:`rope` on GPUs, once
    per process; False for a type whose formula is not known to be transformers' Llama one."""
    if not getattr(family(model_type), "fused", False):
        return False
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    current = module.apply_rotary_pos_emb
    if not getattr(current, "lctrain_fused", False):
        module.apply_rotary_pos_emb = _fused(current)
    return True
