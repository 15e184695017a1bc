"""Experimental single-pass flash-attention backward: dQ by TMA reduce-add (FlashAttention-3).

``backward.py`` runs two kernels, dK/dV and dQ, with 7 tile matrix products (dQ recomputes
``S = Q K^T`` and ``dP = dO V^T``). This module runs ONE pass over the key tiles with the 5
products of FlashAttention (the notation of ``backward.py``):

    for each key tile (K, V on chip), each query head of the GQA group, each query tile:
        P^T  = exp2(K Q^T * scale * log2(e) - lse * log2(e))      (BLOCK_N, BLOCK_M)   1
        dV  += P^T dO                                                                  2
        dP^T = V dO^T                                                                  3
        dS^T = P^T * (dP^T - delta)
        dK  += dS^T Q                                                                  4
        dQ_acc[query tile] += (K^T dS^T)  (D, BLOCK_M) float32, reduce-added in memory 5

dQ rows are sums over key tiles, i.e. over programs, so step 5 must add into a shared
float32 buffer. Element-wise ``tl.atomic_add`` was measured slower than the two-kernel split
(``backward.py``'s docstring). FlashAttention-3 instead hands the whole (BLOCK_M, D) tile to
the TMA unit as ONE bulk asynchronous reduce-add (``cp.reduce.async.bulk.tensor``) from shared
memory: the program issues one instruction per tile and the adds happen in L2. In Triton that
is ``desc.atomic_add([row, col], tile)`` on a tensor descriptor of the accumulator.

dQ is computed transposed, ``dQ^T = K^T dS^T`` (FlashAttention-3's "swap AB"): both operands
then come from shared memory (K stays there; dS^T goes there for the product anyway) and the
product has D = 128 rows for the two warpgroups instead of BLOCK_M. On an H200 this ran 5%
faster than ``dS K`` (338 against 322 TFLOP/s backward at 16K, 32 x 128 tiles). So the
accumulator is kept transposed too: ``dq_acc`` (B * Hq * HEAD_DIM_PAD, SQ_PAD) float32, zeroed
before the pass, a (HEAD_DIM_PAD, SQ_PAD) slab per (batch, head) with the query rows as
columns. ``SQ_PAD`` is Sq rounded up to BLOCK_M, so the ragged last query tile adds its (zero)
columns past Sq into padding, and padded head-dim rows are plain zero rows: every TMA box lies
inside the buffer. After the pass, :func:`attn_bwd_dq_convert_kernel` writes
``dq = scale * dq_acc^T`` in q's dtype, (B, Sq, Hq, D).

Costs against the two-kernel backward: a zeroed float32 dQ buffer (B * Hq * Sq * D * 4 bytes,
1 GiB at 64K x 32 heads x 128), one extra (BLOCK_M, D) float32 tile of registers and shared
memory per step, and a non-deterministic summation order of dQ (the same inputs may differ in
the last bits between runs). dK and dV are still summed in registers, as in ``backward.py``.

Measured on an H200 with Triton 3.6 (``docs/measurements/2026-11-22-bwd-tma-H200.log``), it
does NOT beat the two-kernel backward: 336 against 350 TFLOP/s at 16K and 347 against 358 at
64K (best tiles 32 x 128, 3 stages, 8 warps). The kernel sits at 255 registers per thread (dK
and dV alone take 128) and every product but dK and dV is waited for at once; FlashAttention-3
gets its speed from warp specialisation (a producer warp issues the loads and the dQ
reduce-adds, two MMA warpgroups with raised register limits), which ``tl.range(...,
warp_specialize=True)`` did not give this loop (same registers, same time).

Under ``TRITON_INTERPRET=1`` there is no TMA (the interpreter has no descriptor reduce), so
``TMA_REDUCE=False`` swaps step 5 for an element-wise ``tl.atomic_add`` on the same buffer;
everything else is the same code, which is how the CPU tests check it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lctrain_kernels.triton.common import key_intervals, load_rows, store_rows, tile_ranges


@triton.jit
def _add_dqT(DQ_ACC, row, col, dqT, offs_m, offs_d, SQ_PAD, TMA_REDUCE: tl.constexpr):
    """dq_acc[row : row + HEAD_DIM_PAD, col : col + BLOCK_M] += dqT, float32."""
    if TMA_REDUCE:
        DQ_ACC.atomic_add([row, col], dqT)  # one bulk TMA reduce-add of the whole tile
    else:
        ptrs = DQ_ACC + (row.to(tl.int64) + offs_d[:, None]) * SQ_PAD + col + offs_m[None, :]
        tl.atomic_add(ptrs, dqT)


@triton.jit
def _dkdvdq_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, DQ_ACC, dq_row0, SQ_PAD,
                  stride_qs, stride_ds, stride_qh, stride_dh, GROUP, lo, hi, start, end, Sq,
                  qk_scale, offs_m, offs_d, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr,
                  DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                  TMA_REDUCE: tl.constexpr):
    """Query tiles ``[start, end)`` of all GROUP heads: add to dk, dv; reduce-add dQ partials.

    One flat loop over (head, tile) as in ``backward._dkdv_tiles``. ``dq_row0`` is the first
    ``dq_acc`` row of the group's first head; heads are ``HEAD_DIM_PAD`` rows apart.
    """
    LOG2E: tl.constexpr = 1.4426950408889634
    n_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
    for it in range(0, GROUP * n_tiles):
        g = it // n_tiles
        start_m = tl.multiple_of(start + (it - g * n_tiles) * BLOCK_M, BLOCK_M)
        rows = start_m + offs_m
        g64 = g.to(tl.int64)
        q = load_rows(q_ptr + g64 * stride_qh, start_m, stride_qs, Sq, offs_m, offs_d, HEAD_DIM,
                      MASKED, PAD_D, UPCAST)  # (BLOCK_M, D)
        if MASKED:
            lse = tl.load(lse_ptr + g64 * Sq + rows, mask=rows < Sq, other=0.0)
        else:
            lse = tl.load(lse_ptr + g64 * Sq + rows)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT * qk_scale - (lse * LOG2E)[None, :])
        if MASKED:
            visible = (rows[None, :] >= lo[:, None]) & (rows[None, :] < hi[:, None])
            pT = tl.where(visible, pT, 0.0)
        do = load_rows(do_ptr + g64 * stride_dh, start_m, stride_ds, Sq, offs_m, offs_d,
                       HEAD_DIM, MASKED, PAD_D, UPCAST)  # (BLOCK_M, D)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PREC)
        if MASKED:
            delta = tl.load(delta_ptr + g64 * Sq + rows, mask=rows < Sq, other=0.0)
        else:
            delta = tl.load(delta_ptr + g64 * Sq + rows)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)  # (BLOCK_N, BLOCK_M)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PREC)
        dqT = tl.dot(tl.trans(k), dsT, input_precision=DOT_PREC)  # (D, BLOCK_M) float32
        _add_dqT(DQ_ACC, dq_row0 + g * HEAD_DIM_PAD, start_m, dqT, offs_m, offs_d, SQ_PAD,
                 TMA_REDUCE)
    return dk, dv


# Scalars that vary between blocks stay unspecialized, as in backward.py.
@triton.jit(do_not_specialize=["causal_off", "Hq", "Hkv", "GROUP", "SQ_PAD"])
def attn_bwd_fused_kernel(
    Q, K, V, DO, DK, DV, DQ_ACC, Lse, Delta, Q_LO, Q_HI,
    sm_scale, causal_off,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    Hq, Hkv, GROUP, Sq, Sk, SQ_PAD,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASK_MODE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, TMA_REDUCE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid: (cdiv(Sk, BLOCK_N), B * Hkv). dK, dV (B, Sk, Hkv, D); dQ partials into DQ_ACC.

    DQ_ACC: a tensor descriptor of the (B * Hq * HEAD_DIM_PAD, SQ_PAD) float32 accumulator
    with block (HEAD_DIM_PAD, BLOCK_M) when TMA_REDUCE, else a pointer to it.
    """
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
    k = load_rows(k_ptr, n0, stride_ks, Sk, offs_r, offs_d, HEAD_DIM, True, PAD_D, UPCAST)
    v = load_rows(v_ptr, n0, stride_vs, Sk, offs_r, offs_d, HEAD_DIM, True, PAD_D, UPCAST)
    lo, hi = key_intervals(offs_n, Sq, Sk, causal_off, Q_LO, Q_HI, MASK_MODE)
    start, full_lo, full_hi, end = tile_ranges(lo, hi, offs_n < Sk, Sq, BLOCK_M)

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    h0 = kvh * GROUP  # first query head of the group
    q_ptr = Q + b.to(tl.int64) * stride_qb + h0.to(tl.int64) * stride_qh
    do_ptr = DO + b.to(tl.int64) * stride_db + h0.to(tl.int64) * stride_dh
    row_ptr = (b * Hq + h0).to(tl.int64) * Sq
    dq_row0 = (b * Hq + h0) * HEAD_DIM_PAD  # < 2**31 (checked by the launcher): TMA takes int32
    lse_ptr = Lse + row_ptr
    delta_ptr = Delta + row_ptr
    if MASK_MODE != 0:  # seen from keys, the causal diagonal comes first
        dk, dv = _dkdvdq_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, DQ_ACC, dq_row0,
                               SQ_PAD, stride_qs, stride_ds, stride_qh, stride_dh, GROUP, lo,
                               hi, start, full_lo, Sq, qk_scale, offs_m, offs_d, HEAD_DIM,
                               HEAD_DIM_PAD, PAD_D, UPCAST, DOT_PREC, BLOCK_M, True, TMA_REDUCE)
    dk, dv = _dkdvdq_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, DQ_ACC, dq_row0,
                           SQ_PAD, stride_qs, stride_ds, stride_qh, stride_dh, GROUP, lo, hi,
                           full_lo, full_hi, Sq, qk_scale, offs_m, offs_d, HEAD_DIM,
                           HEAD_DIM_PAD, PAD_D, UPCAST, DOT_PREC, BLOCK_M, False, TMA_REDUCE)
    dk, dv = _dkdvdq_tiles(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, DQ_ACC, dq_row0,
                           SQ_PAD, stride_qs, stride_ds, stride_qh, stride_dh, GROUP, lo, hi,
                           full_hi, end, Sq, qk_scale, offs_m, offs_d, HEAD_DIM, HEAD_DIM_PAD,
                           PAD_D, UPCAST, DOT_PREC, BLOCK_M, True, TMA_REDUCE)

    dk = dk * sm_scale
    dk_ptr = DK + b.to(tl.int64) * stride_dkb + kvh.to(tl.int64) * stride_dkh
    dv_ptr = DV + b.to(tl.int64) * stride_dvb + kvh.to(tl.int64) * stride_dvh
    store_rows(dk_ptr, n0, stride_dks, Sk, offs_r, offs_d, dk, HEAD_DIM, PAD_D)
    store_rows(dv_ptr, n0, stride_dvs, Sk, offs_r, offs_d, dv, HEAD_DIM, PAD_D)


@triton.jit
def attn_bwd_dq_convert_kernel(DQ_ACC, DQ, sm_scale, stride_dqb, stride_dqs, stride_dqh, Hq, Sq,
                               SQ_PAD, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                               BLOCK_M: tl.constexpr):
    """Grid: (cdiv(Sq, BLOCK_M), B * Hq). dq (B, Sq, Hq, D) = sm_scale * dq_acc^T in its dtype."""
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_PAD
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    m0 = tl.program_id(0) * BLOCK_M
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    acc_ptr = DQ_ACC + bh.to(tl.int64) * HEAD_DIM_PAD * SQ_PAD + m0
    dqT = tl.load(acc_ptr + offs_d[:, None] * SQ_PAD + offs_r[None, :],
                  mask=(m0 + offs_r)[None, :] < Sq, other=0.0)  # (HEAD_DIM_PAD, BLOCK_M)
    dq = tl.trans(dqT)  # (BLOCK_M, HEAD_DIM_PAD) float32
    dq_ptr = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    store_rows(dq_ptr, m0, stride_dqs, Sq, offs_r, offs_d, dq * sm_scale, HEAD_DIM, PAD_D)
