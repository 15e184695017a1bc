"""The merge of a partial attention result into a float32 accumulator, as one Triton kernel.

Same arithmetic as :func:`lctrain_kernels.merge.merge_into` (see there), fused: each program
takes ``BLOCK_R`` rows (one row = one (batch, position, head) and its head dim), reads the two
lse values and both output rows once and writes the accumulator row and its lse once — about
10 bytes per element, where the torch version's separate scale, cast, multiply and add move
about 30. The distributed forward merges several partial results per query row; at 64K tokens
over 2 GPUs those memory-bound passes are a visible share of the step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lctrain_kernels.triton.common import interpreting


@triton.jit
def merge_kernel(Acc, AccLse, Out, Lse, n_rows, S, H,
                 s_ab, s_as, s_ah, s_lb, s_lh, s_ls,
                 s_ob, s_os, s_oh, s_nb, s_nh, s_ns,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid: (cdiv(B * S * H, BLOCK_R),). Rows are numbered (b, s, h) with h fastest."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    h = rows % H
    s = (rows // H) % S
    b = rows // (H * S)
    b, s, h = b.to(tl.int64), s.to(tl.int64), h.to(tl.int64)
    lse_a = tl.load(AccLse + b * s_lb + h * s_lh + s * s_ls, mask=live, other=float("-inf"))
    lse_b = tl.load(Lse + b * s_nb + h * s_nh + s * s_ns, mask=live,
                    other=float("-inf")).to(tl.float32)
    hi = tl.maximum(lse_a, lse_b)
    lo = tl.minimum(lse_a, lse_b)
    hi_safe = tl.where(hi == float("-inf"), 0.0, hi)
    lse = hi + tl.log(1.0 + tl.exp(lo - hi_safe))  # -inf when both pieces saw nothing
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    w_a = tl.exp(lse_a - lse_safe)  # exactly 0 for a piece that saw nothing
    w_b = tl.exp(lse_b - lse_safe)
    d = tl.arange(0, HEAD_DIM_PAD)
    m = live[:, None] & (d[None, :] < HEAD_DIM)
    acc_ptr = Acc + (b * s_ab + s * s_as + h * s_ah)[:, None] + d[None, :]
    out_ptr = Out + (b * s_ob + s * s_os + h * s_oh)[:, None] + d[None, :]
    acc = tl.load(acc_ptr, mask=m, other=0.0)
    out = tl.load(out_ptr, mask=m, other=0.0).to(tl.float32)
    tl.store(acc_ptr, acc * w_a[:, None] + out * w_b[:, None], mask=m)
    tl.store(AccLse + b * s_lb + h * s_lh + s * s_ls, lse, mask=live)


def merge_into_fused(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor) -> None:
    """:func:`lctrain_kernels.merge.merge_into` for float32 accumulators, in one kernel.

    Args: as ``merge_into`` (shapes already checked): acc_out (B, S, H, D) float32 and
    acc_lse (B, H, S) float32, updated in place; out (B, S, H, D) any float dtype; lse
    (B, H, S). Any strides, as long as the head dim of ``acc_out`` and ``out`` is contiguous.
    """
    bsz, seq, heads, dim = acc_out.shape
    n_rows = bsz * seq * heads
    if n_rows == 0:
        return
    pad = max(16, triton.next_power_of_2(dim))
    block = 16 if interpreting() else max(1, min(64, 8192 // pad))
    merge_kernel[(triton.cdiv(n_rows, block),)](
        acc_out, acc_lse, out, lse, n_rows, seq, heads,
        acc_out.stride(0), acc_out.stride(1), acc_out.stride(2),
        acc_lse.stride(0), acc_lse.stride(1), acc_lse.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        HEAD_DIM=dim, HEAD_DIM_PAD=pad, BLOCK_R=block, num_warps=4)
