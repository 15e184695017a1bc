"""Pieces shared by the Triton kernels: masks as per-row intervals, tile loads, rounding.

Every mask lctrain needs (causal at any global offset, documents, both, none) gives each row one
contiguous interval of the other side: query ``i`` sees keys ``[kv_lo[i], kv_hi[i])``, key ``j``
is seen by queries ``[q_lo[j], q_hi[j])``. Causal: ``kv_hi[i] = clamp(i + q_start - k_start + 1,
0, Sk)``; documents: the query's document, cut by the causal bound. From its rows' intervals a
tile learns, by four reductions, ``[start, end)`` (their union: tiles outside are never touched)
and ``[full_lo, full_hi)`` (their intersection rounded inwards to whole tiles: no mask needed),
and walks ``[start, full_lo)`` masked, ``[full_lo, full_hi)`` unmasked, ``[full_hi, end)``
masked, the stage split of Triton's fused-attention tutorial. Mask modes (a constexpr):

    MASK_NONE = 0    intervals [0, n_cols): only the ragged tail tile is masked
    MASK_CAUSAL = 1  computed from the offset q_start - k_start: no arrays read
    MASK_RANGES = 2  read from int32 arrays (:func:`interval_arrays`, documents)

Exponentials are base 2, ``log2(e)`` folded into the softmax scale; the lse leaves as natural log.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MASK_NONE = 0
MASK_CAUSAL = 1
MASK_RANGES = 2


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read at
    launch time): no autotuning there, and bf16 must be upcast right after each load."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _device_bounds(doc_bounds, device) -> torch.Tensor:
    """The bounds on ``device`` without stalling the host (a pinned, asynchronous copy on CUDA:
    a pageable one would synchronise and break the overlap of compute and communication)."""
    host = torch.tensor(doc_bounds, dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def interval_arrays(sq: int, sk: int, q_start: int, k_start: int, causal: bool,
                    doc_bounds, device, *, for_keys: bool):
    """Per-row visible intervals of a document mask as int32 device arrays ``(lo, hi)``:
    the keys each query sees, shape (sq,), or with ``for_keys`` the queries that see each key,
    shape (sk,); ``doc_bounds`` are the global ``cu_seqlens`` as host ints."""
    bounds = _device_bounds(doc_bounds, device)  # (n_docs + 1,)
    rows, start, n_other, other_start = (sk, k_start, sq, q_start) if for_keys else \
        (sq, q_start, sk, k_start)
    pos = torch.arange(start, start + rows, device=device)  # (rows,) global positions
    doc = torch.searchsorted(bounds, pos, right=True) - 1  # (rows,) document index
    lo = (bounds[doc] - other_start).clamp(0, n_other)  # (rows,)
    hi = (bounds[doc + 1] - other_start).clamp(0, n_other)  # (rows,)
    if causal and for_keys:  # queries at or after the key
        lo = torch.maximum(lo, (pos - other_start).clamp(0, n_other))
    elif causal:  # keys at or before the query
        hi = torch.minimum(hi, (pos - other_start + 1).clamp(0, n_other))
    lo = torch.minimum(lo, hi)
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


@triton.jit
def load_rows(ptr, row0, stride_row, n_rows, offs_r, offs_d, HEAD_DIM: tl.constexpr,
              CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr):
    """Load the (ROWS, HEAD_DIM_PAD) tile from row ``row0`` of a (n_rows, HEAD_DIM) slab; the
    row offset is 64-bit (slabs over 2**31 elements), padded columns load as zero."""
    base = ptr + row0.to(tl.int64) * stride_row
    ptrs = base + offs_r[:, None] * stride_row + offs_d[None, :]
    if CHECK_ROWS:
        in_rows = (row0 + offs_r)[:, None] < n_rows
        if PAD_D:
            x = tl.load(ptrs, mask=in_rows & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            x = tl.load(ptrs, mask=in_rows, other=0.0)
    else:
        if PAD_D:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            x = tl.load(ptrs)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def slab_desc(ptr, n_rows, stride_row, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
              HEAD_DIM_PAD: tl.constexpr):
    """A TMA descriptor of the (n_rows, HEAD_DIM) slab at ``ptr``, read in (ROWS, HEAD_DIM_PAD)
    tiles (past the slab: zero). Without TMA kernels pass None where a descriptor would go."""
    return tl.make_tensor_descriptor(ptr, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                     block_shape=[ROWS, HEAD_DIM_PAD])


@triton.jit
def load_tile(desc, ptr, head, row0, stride_row, n_rows, offs_r, offs_d, HEAD_DIM: tl.constexpr,
              CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr,
              TMA: tl.constexpr, GROUPED: tl.constexpr):
    """The tile at row ``row0``: one TMA copy through ``desc``, or per-thread loads
    (:func:`load_rows`); ``GROUPED``: ``desc`` covers (heads, rows, dims), ``head`` picks one."""
    if TMA:
        if GROUPED:
            x = desc.load([head, row0, 0]).reshape(offs_r.shape[0], offs_d.shape[0])
        else:
            x = desc.load([row0, 0])
        if UPCAST:
            x = x.to(tl.float32)
    else:
        x = load_rows(ptr, row0, stride_row, n_rows, offs_r, offs_d, HEAD_DIM, CHECK_ROWS, PAD_D,
                      UPCAST)
    return x


@triton.jit
def store_rows(ptr, row0, stride_row, n_rows, offs_r, offs_d, x, HEAD_DIM: tl.constexpr,
               PAD_D: tl.constexpr):
    """Store a (ROWS, HEAD_DIM_PAD) tile at row ``row0``, casting to the destination dtype."""
    base = ptr + row0.to(tl.int64) * stride_row
    ptrs = base + offs_r[:, None] * stride_row + offs_d[None, :]
    mask = (row0 + offs_r)[:, None] < n_rows
    if PAD_D:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def query_intervals(offs_m, Sq, Sk, causal_off, KV_LO, KV_HI, MASK_MODE: tl.constexpr):
    """Keys ``[lo, hi)`` seen by each query row in ``offs_m`` (rows past Sq: see tile_ranges)."""
    if MASK_MODE == 2:
        lo = tl.load(KV_LO + offs_m, mask=offs_m < Sq, other=0)
        hi = tl.load(KV_HI + offs_m, mask=offs_m < Sq, other=0)
    elif MASK_MODE == 1:
        lo = tl.zeros_like(offs_m)
        hi = tl.minimum(tl.maximum(offs_m + causal_off + 1, 0), Sk)
    else:
        lo = tl.zeros_like(offs_m)
        hi = tl.zeros_like(offs_m) + Sk
    return lo, hi


@triton.jit
def key_intervals(offs_n, Sq, Sk, causal_off, Q_LO, Q_HI, MASK_MODE: tl.constexpr):
    """Queries ``[lo, hi)`` that see each key row in ``offs_n``."""
    if MASK_MODE == 2:
        lo = tl.load(Q_LO + offs_n, mask=offs_n < Sk, other=0)
        hi = tl.load(Q_HI + offs_n, mask=offs_n < Sk, other=0)
    elif MASK_MODE == 1:
        lo = tl.minimum(tl.maximum(offs_n - causal_off, 0), Sq)
        hi = tl.zeros_like(offs_n) + Sq
    else:
        lo = tl.zeros_like(offs_n)
        hi = tl.zeros_like(offs_n) + Sq
    return lo, hi


@triton.jit
def tile_ranges(lo, hi, valid, n_cols, BLOCK: tl.constexpr):
    """Column ranges of one row tile: masked ``[start, full_lo)``, unmasked ``[full_lo, full_hi)``,
    masked ``[full_hi, end)``. All but ``end`` are multiples of BLOCK; see the module docstring."""
    lo_min = tl.min(tl.where(valid, lo, n_cols), 0)
    lo_max = tl.max(tl.where(valid, lo, 0), 0)
    hi_min = tl.min(tl.where(valid, hi, n_cols), 0)
    hi_max = tl.max(tl.where(valid, hi, 0), 0)
    start = (lo_min // BLOCK) * BLOCK
    full_lo = ((lo_max + BLOCK - 1) // BLOCK) * BLOCK
    full_hi = (hi_min // BLOCK) * BLOCK
    has_full = full_hi > full_lo
    full_lo = tl.where(has_full, full_lo, start)
    full_hi = tl.where(has_full, full_hi, start)
    return start, full_lo, full_hi, hi_max


DTYPE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The ``KIND`` constant :func:`round_to` takes for each storage dtype."""


@triton.jit
def round_to(x, KIND: tl.constexpr):
    """float32 ``x`` rounded to float32 (KIND 0), bfloat16 (1) or float16 (2), kept in float32.
    bfloat16 rounds to nearest even by its bits: the interpreter truncates a cast, the GPU
    rounds, and the fused kernels' CPU tests must see the GPU's rounding."""
    if KIND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
