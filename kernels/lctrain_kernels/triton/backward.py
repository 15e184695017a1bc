"""Flash-attention backward in Triton: delta, then dK/dV and dQ in two kernels without atomics.

The gradients of :mod:`lctrain_kernels.reference`, ``P = exp2(S * log2(e) - lse * log2(e))``
recomputed tile by tile from the FINAL (merged) lse, the lse's gradient folded into delta:

1. :func:`attn_bwd_delta_kernel`: delta = rowsum(dO * O), (B, Hq, Sq) float32.
2. :func:`attn_bwd_dkdv_kernel`: one program per key tile of one (batch, KV head); K and V stay
   on chip while it walks the query tiles that see them (the stage split seen from the keys),
   for every query head of its GQA group in one flat loop, summing dK and dV in registers.
3. :func:`attn_bwd_dq_kernel`: one program per query tile, walking key tiles like the forward.

dQ has a kernel of its own because its rows are sums over KEY tiles: computing it in step 2 would
need atomic adds into a shared float32 buffer. Owning its rows costs recomputing S and dP once
more but is deterministic, and each kernel's tiles are tuned on their own (FlashAttention-2's
deterministic path). Tiles are TMA copies where the inputs allow.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lctrain_kernels.triton.common import (key_intervals, load_rows, load_tile,
                                           query_intervals, slab_desc, store_rows, tile_ranges)


@triton.jit
def attn_bwd_delta_kernel(O, DO, Delta, stride_ob, stride_os, stride_oh,
                          stride_db, stride_ds, stride_dh, Hq, Sq,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr):
    """Grid: (cdiv(Sq, BLOCK_M), B * Hq). delta = rowsum(dO * O) in float32."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    m0 = tl.program_id(0) * BLOCK_M
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    o_ptr = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    do_ptr = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
    o = load_rows(o_ptr, m0, stride_os, Sq, offs_r, offs_d, HEAD_DIM, True, PAD_D, True)
    do = load_rows(do_ptr, m0, stride_ds, Sq, offs_r, offs_d, HEAD_DIM, True, PAD_D, True)
    delta = tl.sum(o * do, 1)  # (BLOCK_M,)
    tl.store(Delta + bh.to(tl.int64) * Sq + m0 + offs_r, delta, mask=m0 + offs_r < Sq)


@triton.jit
def _group_desc(ptr, GROUP, n_rows, stride_head, stride_row, HEAD_DIM: tl.constexpr,
                ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """A TMA descriptor of the GQA group's (GROUP, n_rows, HEAD_DIM) rows, read in 3-D tiles."""
    return tl.make_tensor_descriptor(ptr, shape=[GROUP, n_rows, HEAD_DIM],
                                     strides=[stride_head, stride_row, 1],
                                     block_shape=[1, ROWS, HEAD_DIM_PAD])


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qs,
                stride_ds, stride_qh, stride_dh, GROUP, lo, hi, start, end, Sq, qk_scale,
                offs_m, offs_d, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
                UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                MASKED: tl.constexpr, TMA: tl.constexpr):
    """Add the query tiles ``[start, end)`` of all GROUP query heads to dk, dv (BLOCK_N, D), as ONE
    flat loop (an outer loop over heads would keep the inner loop's state alive and spill). Pointers
    are the group's first head's; heads are ``stride_qh``, ``stride_dh``, ``Sq`` apart."""
    LOG2E: tl.constexpr = 1.4426950408889634
    n_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    for it in range(0, GROUP * n_tiles):
        g = it // n_tiles
        start_m = tl.multiple_of(start + (it - g * n_tiles) * BLOCK_M, BLOCK_M)
        rows = start_m + offs_m
        g64 = g.to(tl.int64)
        q = load_tile(q_desc, q_ptr + g64 * stride_qh, g, start_m, stride_qs, Sq, offs_m, offs_d,
                      HEAD_DIM, MASKED, PAD_D, UPCAST, TMA, True)  # (BLOCK_M, D)
        if MASKED:
            lse = tl.load(lse_ptr + g64 * Sq + rows, mask=rows < Sq, other=0.0)
        else:
            lse = tl.load(lse_ptr + g64 * Sq + rows)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT * qk_scale - (lse * LOG2E)[None, :])
        if MASKED:
            visible = (rows[None, :] >= lo[:, None]) & (rows[None, :] < hi[:, None])
            pT = tl.where(visible, pT, 0.0)
        do = load_tile(do_desc, do_ptr + g64 * stride_dh, g, start_m, stride_ds, Sq, offs_m,
                       offs_d, HEAD_DIM, MASKED, PAD_D, UPCAST, TMA, True)  # (BLOCK_M, D)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        if MASKED:
            delta = tl.load(delta_ptr + g64 * Sq + rows, mask=rows < Sq, other=0.0)
        else:
            delta = tl.load(delta_ptr + g64 * Sq + rows)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)  # (BLOCK_N, BLOCK_M)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit(do_not_specialize=["causal_off", "Hq", "Hkv", "GROUP", "SEQ_BUCKET"])
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, Lse, Delta, Q_LO, Q_HI,
    sm_scale, causal_off,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    Hq, Hkv, GROUP, Sq, Sk, SEQ_BUCKET,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASK_MODE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (cdiv(Sk, BLOCK_N), B * Hkv). dK, dV (B, Sk, Hkv, D), summed over the GQA group."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
    bkv = tl.program_id(1)
    b = bkv // Hkv
    kvh = bkv % Hkv
    n0 = tl.program_id(0) * BLOCK_N
    offs_r = tl.arange(0, BLOCK_N)
    offs_n = n0 + offs_r
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)

    k_ptr = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_ptr = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    k_desc = slab_desc(k_ptr, Sk, stride_ks, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD) if TMA else None
    v_desc = slab_desc(v_ptr, Sk, stride_vs, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD) if TMA else None
    k = load_tile(k_desc, k_ptr, 0, n0, stride_ks, Sk, offs_r, offs_d, HEAD_DIM, True, PAD_D,
                  UPCAST, TMA, False)
    v = load_tile(v_desc, v_ptr, 0, n0, stride_vs, Sk, offs_r, offs_d, HEAD_DIM, True, PAD_D,
                  UPCAST, TMA, False)
    lo, hi = key_intervals(offs_n, Sq, Sk, causal_off, Q_LO, Q_HI, MASK_MODE)
    start, full_lo, full_hi, end = tile_ranges(lo, hi, offs_n < Sk, Sq, BLOCK_M)

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    h0 = kvh * GROUP  # first query head of the group
    q_ptr = Q + b.to(tl.int64) * stride_qb + h0.to(tl.int64) * stride_qh
    do_ptr = DO + b.to(tl.int64) * stride_db + h0.to(tl.int64) * stride_dh
    row_ptr = (b * Hq + h0).to(tl.int64) * Sq
    q_desc = (_group_desc(q_ptr, GROUP, Sq, stride_qh, stride_qs, HEAD_DIM, BLOCK_M, HEAD_DIM_PAD)
              if TMA else None)
    do_desc = (_group_desc(do_ptr, GROUP, Sq, stride_dh, stride_ds, HEAD_DIM, BLOCK_M,
                           HEAD_DIM_PAD) if TMA else None)
    lse_ptr = Lse + row_ptr
    delta_ptr = Delta + row_ptr
    if MASK_MODE != 0:  # seen from keys, the causal diagonal comes first
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, q_ptr, do_ptr, lse_ptr, delta_ptr,
                             stride_qs, stride_ds, stride_qh, stride_dh, GROUP, lo, hi, start,
                             full_lo, Sq, qk_scale, offs_m, offs_d, HEAD_DIM, PAD_D,
                             UPCAST, DOT_PREC, BLOCK_M, True, TMA)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, q_ptr, do_ptr, lse_ptr, delta_ptr,
                         stride_qs, stride_ds, stride_qh, stride_dh, GROUP, lo, hi, full_lo,
                         full_hi, Sq, qk_scale, offs_m, offs_d, HEAD_DIM, PAD_D,
                         UPCAST, DOT_PREC, BLOCK_M, False, TMA)
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_desc, do_desc, q_ptr, do_ptr, lse_ptr, delta_ptr,
                         stride_qs, stride_ds, stride_qh, stride_dh, GROUP, lo, hi, full_hi,
                         end, Sq, qk_scale, offs_m, offs_d, HEAD_DIM, PAD_D,
                         UPCAST, DOT_PREC, BLOCK_M, True, TMA)

    dk = dk * sm_scale
    dk_ptr = DK + b.to(tl.int64) * stride_dkb + kvh.to(tl.int64) * stride_dkh
    dv_ptr = DV + b.to(tl.int64) * stride_dvb + kvh.to(tl.int64) * stride_dvh
    store_rows(dk_ptr, n0, stride_dks, Sk, offs_r, offs_d, dk, HEAD_DIM, PAD_D)
    store_rows(dv_ptr, n0, stride_dvs, Sk, offs_r, offs_d, dv, HEAD_DIM, PAD_D)


@triton.jit
def _dq_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_ptr, v_ptr, stride_ks, stride_vs, lo,
              hi, start, end, Sk, qk_scale, offs_n, offs_d, HEAD_DIM: tl.constexpr,
              PAD_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
              BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """Add the key tiles ``[start, end)`` to dq (BLOCK_M, D)."""
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = load_tile(k_desc, k_ptr, 0, start_n, stride_ks, Sk, offs_n, offs_d, HEAD_DIM, MASKED,
                      PAD_D, UPCAST, TMA, False)  # (BLOCK_N, D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            cols = start_n + offs_n
            visible = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
            p = tl.where(visible, p, 0.0)
        v = load_tile(v_desc, v_ptr, 0, start_n, stride_vs, Sk, offs_n, offs_d, HEAD_DIM, MASKED,
                      PAD_D, UPCAST, TMA, False)  # (BLOCK_N, D)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit(do_not_specialize=["causal_off", "Hq", "GROUP", "SEQ_BUCKET"])
def attn_bwd_dq_kernel(
    Q, K, V, DO, DQ, Lse, Delta, KV_LO, KV_HI,
    sm_scale, causal_off,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dqb, stride_dqs, stride_dqh,
    Hq, GROUP, Sq, Sk, SEQ_BUCKET,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASK_MODE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (cdiv(Sq, BLOCK_M), B * Hq). dQ (B, Sq, Hq, D)."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    LOG2E: tl.constexpr = 1.4426950408889634
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
    do_ptr = DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
    k_ptr = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    v_ptr = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
    q_desc = slab_desc(q_ptr, Sq, stride_qs, HEAD_DIM, BLOCK_M, HEAD_DIM_PAD) if TMA else None
    do_desc = slab_desc(do_ptr, Sq, stride_ds, HEAD_DIM, BLOCK_M, HEAD_DIM_PAD) if TMA else None
    k_desc = slab_desc(k_ptr, Sk, stride_ks, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD) if TMA else None
    v_desc = slab_desc(v_ptr, Sk, stride_vs, HEAD_DIM, BLOCK_N, HEAD_DIM_PAD) if TMA else None
    q = load_tile(q_desc, q_ptr, 0, m0, stride_qs, Sq, offs_r, offs_d, HEAD_DIM, True, PAD_D,
                  UPCAST, TMA, False)
    do = load_tile(do_desc, do_ptr, 0, m0, stride_ds, Sq, offs_r, offs_d, HEAD_DIM, True, PAD_D,
                   UPCAST, TMA, False)
    row_ptr = bh.to(tl.int64) * Sq
    lse2 = tl.load(Lse + row_ptr + offs_m, mask=offs_m < Sq, other=0.0) * LOG2E
    delta = tl.load(Delta + row_ptr + offs_m, mask=offs_m < Sq, other=0.0)

    lo, hi = query_intervals(offs_m, Sq, Sk, causal_off, KV_LO, KV_HI, MASK_MODE)
    start, full_lo, full_hi, end = tile_ranges(lo, hi, offs_m < Sq, Sk, BLOCK_N)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    if MASK_MODE == 2:
        dq = _dq_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_ptr, v_ptr, stride_ks,
                       stride_vs, lo, hi, start, full_lo, Sk, qk_scale, offs_n, offs_d,
                       HEAD_DIM, PAD_D, UPCAST, DOT_PREC, BLOCK_N, True, TMA)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_ptr, v_ptr, stride_ks,
                   stride_vs, lo, hi, full_lo, full_hi, Sk, qk_scale, offs_n, offs_d,
                   HEAD_DIM, PAD_D, UPCAST, DOT_PREC, BLOCK_N, False, TMA)
    dq = _dq_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_ptr, v_ptr, stride_ks,
                   stride_vs, lo, hi, full_hi, end, Sk, qk_scale, offs_n, offs_d,
                   HEAD_DIM, PAD_D, UPCAST, DOT_PREC, BLOCK_N, True, TMA)
    dq_ptr = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    store_rows(dq_ptr, m0, stride_dqs, Sq, offs_r, offs_d, dq * sm_scale, HEAD_DIM, PAD_D)
