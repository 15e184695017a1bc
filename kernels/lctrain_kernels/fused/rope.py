"""Rotary position embedding of token-major q and k in one Triton kernel each way (transformers'
Llama formula), for the attention block of head groups (`lctrain_kernels.fused.block`).

One kernel reads q, k, cos and sin once and writes both results once as contiguous (B, S, H, D),
the layout the attention reads; the backward applies the rotation's transpose the same way.
float32 arithmetic rounded once. A whole model's RoPE runs Liger-Kernel's (`lctrain.model.fused`)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lctrain_kernels.triton.common import DTYPE_KINDS, last_dim_contiguous, round_to


@triton.jit
def _rope_kernel(Q, K, OQ, OK, Cos, Sin, S, Hq, Hk, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h,
                 sc_b, sc_s, KIND: tl.constexpr, BACKWARD: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr):
    """One token: q's and k's heads rotated, with halves (x1, x2): forward (x1·c1 − x2·s1,
    x2·c2 + x1·s2), BACKWARD the transpose (x1·c1 + x2·s2, x2·c2 − x1·s1)."""
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
    """The H heads of one token of X into contiguous OUT: (x1·c1 + x2·a, x2·c2 + x1·e)."""
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


@torch.library.custom_op("lctrain::rope", mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Hq, S, D) and k (B, Hk, S, D) rotated by cos/sin (B, S, D), all with D contiguous
    (``backward``: by the transpose), as contiguous (B, S, H, D) tensors."""
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
    return oq, ok


@rope_op.register_fake
def _(q, k, cos, sin, backward):
    return (q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3])),
            k.new_empty((k.shape[0], k.shape[2], k.shape[1], k.shape[3])))


def rotate_tokens(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel, without autograd, on token-major q (B, S, Hq, D) and k (B, S, Hk, D) with
    cos/sin (B, S, D) of any float dtype; returns contiguous (B, S, H, D) tensors."""
    return torch.ops.lctrain.rope(q.transpose(1, 2), k.transpose(1, 2),
                                  last_dim_contiguous(cos), last_dim_contiguous(sin), backward)

