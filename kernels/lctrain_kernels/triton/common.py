"""Pieces shared by the forward and backward Triton kernels: masks as per-row intervals.

Every mask lctrain needs (causal with any global offset, packed documents, both, or none) has
one shape: each row sees one contiguous interval of the other side. Query row ``i`` sees the
keys ``[kv_lo[i], kv_hi[i])`` (local key indices), and key row ``j`` is seen by the queries
``[q_lo[j], q_hi[j])``:

* no mask:   ``kv = [0, Sk)``;
* causal:    ``kv_hi[i] = clamp(i + (q_start - k_start) + 1, 0, Sk)`` (key global position at
  most the query's); seen from a key, ``q_lo[j] = clamp(j - (q_start - k_start), 0, Sq)``;
* documents: the interval is the query's document, cut by the causal bound when causal.

The kernels work on tiles of ``BLOCK`` rows against tiles of columns. From the rows' intervals
one tile of rows learns, with four reductions and no per-tile metadata:

* ``[start, end)``: the union of all intervals — tiles outside it are never touched, so the
  empty tiles of a causal mask or of foreign documents cost nothing;
* ``[full_lo, full_hi)``: the intersection, rounded inwards to whole column tiles — every
  pair there is visible, so those tiles skip the elementwise mask and the bounds checks.

A row tile then walks ``[start, full_lo)`` masked, ``[full_lo, full_hi)`` unmasked and
``[full_hi, end)`` masked (the "stage split" of Triton's fused-attention tutorial, where the
diagonal tiles of a causal mask are the masked ones). Mask modes (a constexpr):

    MASK_NONE = 0    intervals are [0, n_cols): only the ragged tail tile is masked
    MASK_CAUSAL = 1  computed from the offset q_start - k_start: no arrays read
    MASK_RANGES = 2  read from int32 arrays built by :func:`interval_arrays` (documents)

Exponentials are base 2: ``exp(x) = exp2(x * log2(e))``, with ``log2(e)`` folded into the
softmax scale, and the log-sum-exp converted back to the natural log on the way out.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MASK_NONE = 0
MASK_CAUSAL = 1
MASK_RANGES = 2

LOG2E = 1.4426950408889634  # 1 / ln(2)
LN2 = 0.6931471805599453


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (Triton's own ``TRITON_INTERPRET``).

    Read at launch time, never at import: the interpreter needs autotuning off and (for bf16)
    an upcast right after each load, because it holds bf16 as raw integers.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _device_bounds(doc_bounds, device) -> torch.Tensor:
    """The bounds as an int64 tensor on ``device`` without stalling the host: a plain copy from
    pageable memory would synchronise the stream (and break compute/communication overlap),
    so CUDA gets a pinned buffer and an asynchronous copy."""
    host = torch.tensor(doc_bounds, dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def interval_arrays(sq: int, sk: int, q_start: int, k_start: int, causal: bool,
                    doc_bounds, device, *, for_keys: bool):
    """Per-row visible intervals of a document mask, as int32 device arrays.

    Args:
        sq, sk: query and key rows of the block.
        q_start, k_start: global positions of the first query and key row.
        causal: also hide keys after the query.
        doc_bounds: global ``cu_seqlens`` as host ints ``(0, ..., N)``.
        device: where the arrays live.
        for_keys: False: ``(kv_lo, kv_hi)`` of shape (sq,), the keys each query sees;
            True: ``(q_lo, q_hi)`` of shape (sk,), the queries that see each key.

    Returns:
        Two int32 tensors ``(lo, hi)`` with ``0 <= lo <= hi <= other side's length``.
    """
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
    """Load a (ROWS, HEAD_DIM_PAD) tile whose first row is ``row0`` of a (n_rows, HEAD_DIM) slab.

    The row offset is applied to the base pointer in 64 bits, so slabs over 2**31 elements
    (e.g. 512K tokens x 32 heads x 128) stay addressable. Padded columns load as zero.
    """
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
    """A TMA descriptor of the (n_rows, HEAD_DIM) slab at ``ptr`` read in (ROWS, HEAD_DIM_PAD)
    tiles. Rows and columns past the slab load as zero (hardware bounds). Kernels without TMA
    pass None where a descriptor would go (Triton 3.6 cannot return None from a function)."""
    return tl.make_tensor_descriptor(ptr, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                     block_shape=[ROWS, HEAD_DIM_PAD])


@triton.jit
def load_tile(desc, ptr, head, row0, stride_row, n_rows, offs_r, offs_d, HEAD_DIM: tl.constexpr,
              CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr, UPCAST: tl.constexpr,
              TMA: tl.constexpr, GROUPED: tl.constexpr):
    """The (ROWS, HEAD_DIM_PAD) tile at row ``row0``: one TMA copy through ``desc`` straight
    into shared memory, or (no TMA) per-thread loads as :func:`load_rows`.

    ``GROUPED``: ``desc`` covers (heads, rows, dims) and ``head`` picks the head (``ptr``
    already points at that head, for the pointer path); otherwise ``head`` is unused.
    """
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
