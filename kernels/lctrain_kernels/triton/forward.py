"""Flash-attention forward in Triton: online softmax over key tiles, base-2 exponentials.

One program owns BLOCK_M query rows of one (batch, query head) and keeps FlashAttention-2's running
state: the row maximum ``m_i`` (log2 units), the sum ``l_i`` of ``exp2(s - m_i)`` and the float32
accumulator ``acc``. Per key tile: ``s = q k^T * scale * log2(e)``, ``m_new = max(m_i, rowmax(s))``,
``p = exp2(s - m_new)``, the state rescaled by ``exp2(m_i - m_new)``, ``acc += p v``. At the end
``out = acc / l_i`` and ``lse = (m_i + log2(l_i)) * ln(2)``. Query head ``h`` reads K/V head
``h // GROUP``. Key tiles come from :func:`~lctrain_kernels.triton.common.tile_ranges` (unseen ones
skipped, fully visible ones unmasked); a row that sees nothing stores out = 0 and lse = -inf. Causal
programs start with the heaviest tiles; tiles are TMA copies where possible."""
from __future__ import annotations

import triton
import triton.language as tl

from lctrain_kernels.triton.common import (load_tile, query_intervals, slab_desc, store_rows,
                                           tile_ranges)


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, k_ptr, v_ptr, stride_ks, stride_vs, lo, hi,
               start, end, Sk, qk_scale, offs_n, offs_d, HEAD_DIM: tl.constexpr,
               PAD_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
               TMA: tl.constexpr):
    """Fold the key tiles ``[start, end)`` into the running (acc, l_i, m_i)."""
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = load_tile(k_desc, k_ptr, 0, start_n, stride_ks, Sk, offs_n, offs_d, HEAD_DIM, MASKED,
                      PAD_D, UPCAST, TMA, False)  # (BLOCK_N, D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        if MASKED:
            cols = start_n + offs_n
            visible = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            qk = qk - m_use[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            qk = qk * qk_scale - m_use[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_tile(v_desc, v_ptr, 0, start_n, stride_vs, Sk, offs_n, offs_d, HEAD_DIM, MASKED,
                      PAD_D, UPCAST, TMA, False)  # (BLOCK_N, D)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


# Scalars that vary between blocks stay unspecialized (here and in the backward): one binary
# serves all GQA groups, diagonal offsets and autotune buckets.
@triton.jit(do_not_specialize=["causal_off", "Hq", "GROUP", "SEQ_BUCKET"])
def attn_fwd_kernel(
    Q, K, V, Out, Lse, KV_LO, KV_HI,
    sm_scale, causal_off,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    Hq, GROUP, Sq, Sk, SEQ_BUCKET,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASK_MODE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (cdiv(Sq, BLOCK_M), B * Hq). Q/Out (B, Sq, Hq, D), K/V (B, Sk, Hkv, D), last dim
    contiguous; Lse (B, Hq, Sq) float32 contiguous. SEQ_BUCKET only keys the autotuner."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    pid_m = tl.program_id(0)
    if MASK_MODE == 1:
        pid_m = tl.num_programs(0) - 1 - pid_m  # heaviest causal tiles first
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    kvh = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_r
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)

    q_ptr = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_ptr = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_ptr = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    q_desc = slab_desc(q_ptr, Sq, stride_qs, HEAD_DIM, BLOCK_M, HEAD_DIM_PAD) if TMA else None
    k_desc = slab_desc(k_ptr, Sk, stride_ks, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD) if TMA else None
    v_desc = slab_desc(v_ptr, Sk, stride_vs, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD) if TMA else None
    q = load_tile(q_desc, q_ptr, 0, m0, stride_qs, Sq, offs_r, offs_d, HEAD_DIM, True, PAD_D,
                  UPCAST, TMA, False)

    lo, hi = query_intervals(offs_m, Sq, Sk, causal_off, KV_LO, KV_HI, MASK_MODE)
    start, full_lo, full_hi, end = tile_ranges(lo, hi, offs_m < Sq, Sk, BLOCK_N)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    if MASK_MODE == 2:  # document edges before the fully visible run
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, k_ptr, v_ptr, stride_ks,
                                   stride_vs, lo, hi, start, full_lo, Sk, qk_scale, offs_n, offs_d,
                                   HEAD_DIM, PAD_D, UPCAST, DOT_PREC, BLOCK_N, True, False, TMA)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, k_ptr, v_ptr, stride_ks,
                               stride_vs, lo, hi, full_lo, full_hi, Sk, qk_scale, offs_n, offs_d,
                               HEAD_DIM, PAD_D, UPCAST, DOT_PREC, BLOCK_N, False, WARP_SPECIALIZE,
                               TMA)
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, k_ptr, v_ptr, stride_ks,
                               stride_vs, lo, hi, full_hi, end, Sk, qk_scale, offs_n, offs_d,
                               HEAD_DIM, PAD_D, UPCAST, DOT_PREC, BLOCK_N, True, False, TMA)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw nothing: out 0, lse -inf
    out = acc / l_safe[:, None]
    o_ptr = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    store_rows(o_ptr, m0, stride_os, Sq, offs_r, offs_d, out, HEAD_DIM, PAD_D)
    lse = (m_i + tl.math.log2(l_safe)) * LN2
    lse_ptr = Lse + bh.to(tl.int64) * Sq
    tl.store(lse_ptr + offs_m, lse, mask=offs_m < Sq)
