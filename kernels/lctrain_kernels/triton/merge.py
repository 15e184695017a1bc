"""The sums and lse merges of :mod:`lctrain_kernels.combine` in one memory pass, for up to
:data:`MAX_INPUTS` inputs at a time. Each program reads ``BLOCK_R`` rows (one (batch, position,
head) each) of every input once and writes the result once; ``dst`` may be one of the inputs (every
element is read before it is written, by the same program). Unused input slots get the first input,
never read."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lctrain_kernels.triton.common import interpreting

MAX_INPUTS = 4
_LSE_STRIDES = ("dl_b", "dl_h", "l0_b", "l0_h", "l1_b", "l1_h", "l2_b", "l2_h", "l3_b", "l3_h")


@triton.jit
def _rows(rows, S, H):
    """(b, s, h) of flat row numbers, h fastest, as int64."""
    h = rows % H
    s = (rows // H) % S
    b = rows // (H * S)
    return b.to(tl.int64), s.to(tl.int64), h.to(tl.int64)


@triton.jit
def _load(ptr, b, s, h, sb, ss, sh, d, m):
    return tl.load(ptr + (b * sb + s * ss + h * sh)[:, None] + d[None, :], mask=m,
                   other=0.0).to(tl.float32)


@triton.jit
def sum_kernel(Dst, X0, X1, X2, X3, n_rows, S, H,
               d_b, d_s, d_h, x0_b, x0_s, x0_h, x1_b, x1_s, x1_h,
               x2_b, x2_s, x2_h, x3_b, x3_s, x3_h,
               N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """Grid: (cdiv(B * S * H, BLOCK_R),). dst = sum of the first N inputs, (B, S, H, D) each."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    b, s, h = _rows(rows, S, H)
    d = tl.arange(0, HEAD_DIM_PAD)
    m = live[:, None] & (d[None, :] < HEAD_DIM)
    acc = _load(X0, b, s, h, x0_b, x0_s, x0_h, d, m)  # (BLOCK_R, D) float32
    if N > 1:
        acc += _load(X1, b, s, h, x1_b, x1_s, x1_h, d, m)
    if N > 2:
        acc += _load(X2, b, s, h, x2_b, x2_s, x2_h, d, m)
    if N > 3:
        acc += _load(X3, b, s, h, x3_b, x3_s, x3_h, d, m)
    dst = Dst + (b * d_b + s * d_s + h * d_h)[:, None] + d[None, :]
    tl.store(dst, acc.to(Dst.dtype.element_ty), mask=m)


@triton.jit
def _lse(L, b, s, h, lb, lh, ls, live):
    return tl.load(L + b * lb + h * lh + s * ls, mask=live, other=float("-inf")).to(tl.float32)


# lse slices' starts and buffer lengths move with each document layout: no specialising on them
@triton.jit(do_not_specialize=_LSE_STRIDES,
            do_not_specialize_on_alignment=("DstLse", "L0", "L1", "L2", "L3", *_LSE_STRIDES))
def merge_kernel(Dst, DstLse, X0, L0, X1, L1, X2, L2, X3, L3, n_rows, S, H,
                 d_b, d_s, d_h, dl_b, dl_h, dl_s,
                 x0_b, x0_s, x0_h, l0_b, l0_h, l0_s, x1_b, x1_s, x1_h, l1_b, l1_h, l1_s,
                 x2_b, x2_s, x2_h, l2_b, l2_h, l2_s, x3_b, x3_s, x3_h, l3_b, l3_h, l3_s,
                 N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """Grid: (cdiv(B * S * H, BLOCK_R),). Merge N partial (out (B, S, H, D), lse (B, H, S))."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    b, s, h = _rows(rows, S, H)
    l0 = _lse(L0, b, s, h, l0_b, l0_h, l0_s, live)  # (BLOCK_R,)
    l1 = _lse(L1, b, s, h, l1_b, l1_h, l1_s, live) if N > 1 else l0
    l2 = _lse(L2, b, s, h, l2_b, l2_h, l2_s, live) if N > 2 else l0
    l3 = _lse(L3, b, s, h, l3_b, l3_h, l3_s, live) if N > 3 else l0
    hi = tl.maximum(tl.maximum(l0, l1), tl.maximum(l2, l3))
    hi_safe = tl.where(hi == float("-inf"), 0.0, hi)
    total = tl.exp(l0 - hi_safe)
    if N > 1:
        total += tl.exp(l1 - hi_safe)
    if N > 2:
        total += tl.exp(l2 - hi_safe)
    if N > 3:
        total += tl.exp(l3 - hi_safe)
    none = hi == float("-inf")  # no input saw a key of this row
    lse = tl.where(none, float("-inf"), hi_safe + tl.log(tl.where(none, 1.0, total)))
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    d = tl.arange(0, HEAD_DIM_PAD)
    m = live[:, None] & (d[None, :] < HEAD_DIM)
    acc = _load(X0, b, s, h, x0_b, x0_s, x0_h, d, m) * tl.exp(l0 - lse_safe)[:, None]
    if N > 1:
        acc += _load(X1, b, s, h, x1_b, x1_s, x1_h, d, m) * tl.exp(l1 - lse_safe)[:, None]
    if N > 2:
        acc += _load(X2, b, s, h, x2_b, x2_s, x2_h, d, m) * tl.exp(l2 - lse_safe)[:, None]
    if N > 3:
        acc += _load(X3, b, s, h, x3_b, x3_s, x3_h, d, m) * tl.exp(l3 - lse_safe)[:, None]
    dst = Dst + (b * d_b + s * d_s + h * d_h)[:, None] + d[None, :]
    tl.store(dst, acc.to(Dst.dtype.element_ty), mask=m)
    tl.store(DstLse + b * dl_b + h * dl_h + s * dl_s, lse, mask=live)


def _launch_shape(dst: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(grid, rows, pad, block, warps) for a (B, S, H, D) destination."""
    bsz, seq, heads, dim = dst.shape
    n_rows = bsz * seq * heads
    pad = max(16, triton.next_power_of_2(dim))
    block = 16 if interpreting() else max(1, min(64, 8192 // pad))
    return triton.cdiv(n_rows, block), n_rows, pad, block, 4


def _check_count(n: int) -> None:
    if not 1 <= n <= MAX_INPUTS:
        raise ValueError(f"the fused combine takes 1 to {MAX_INPUTS} inputs at a time, got {n}.")


def sum_fused(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``dst = sum(parts)`` of 1 to MAX_INPUTS (B, S, H, D) tensors in one kernel."""
    _check_count(len(parts))
    grid, n_rows, pad, block, warps = _launch_shape(dst)
    if n_rows == 0:
        return
    xs = (parts + [parts[0]] * MAX_INPUTS)[:MAX_INPUTS]
    strides = [st for x in xs for st in x.stride()[:3]]
    sum_kernel[(grid,)](dst, *xs, n_rows, dst.shape[1], dst.shape[2], *dst.stride()[:3], *strides,
                        N=len(parts), HEAD_DIM=dst.shape[3], HEAD_DIM_PAD=pad, BLOCK_R=block,
                        num_warps=warps)


def merge_fused(dst: torch.Tensor, dst_lse: torch.Tensor,
                parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Merge 1 to MAX_INPUTS pairs (out, lse) into ``dst`` and float32 ``dst_lse`` in one kernel."""
    _check_count(len(parts))
    grid, n_rows, pad, block, warps = _launch_shape(dst)
    if n_rows == 0:
        return
    pairs = (parts + [parts[0]] * MAX_INPUTS)[:MAX_INPUTS]
    args = [t for pair in pairs for t in pair]
    strides = [st for x, lse in pairs for st in (*x.stride()[:3], *lse.stride())]
    merge_kernel[(grid,)](dst, dst_lse, *args, n_rows, dst.shape[1], dst.shape[2],
                          *dst.stride()[:3], *dst_lse.stride(), *strides, N=len(parts),
                          HEAD_DIM=dst.shape[3], HEAD_DIM_PAD=pad, BLOCK_R=block,
                          num_warps=warps)
