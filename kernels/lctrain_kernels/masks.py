"""Which (query, key) pairs of an attention block are visible — decided on the host, up front.

Every local attention call in lctrain computes one *block*: the queries at global positions
``q_start .. q_start + sq - 1`` against the keys at ``k_start .. k_start + sk - 1``. Two rules
decide whether query ``i`` may look at key ``j`` (both global positions):

* causal:    ``j <= i``;
* documents: ``i`` and ``j`` lie in the same packed document, where ``doc_bounds`` is the
  global ``cu_seqlens`` as host ints ``(0, b1, ..., N)``; document ``d`` is ``[b_d, b_{d+1})``.

Before any kernel launch or send, :func:`classify` sorts a block into one of four relations::

    EMPTY    nothing visible           -> skip the block entirely (no launch, no communication)
    FULL     everything visible        -> plain non-causal attention (fast dense kernels)
    CAUSAL   the lower triangle from the top-left corner: q_start == k_start, one document
             (query row i sees key rows 0..i; sq and sk may differ)
    PARTIAL  anything else             -> an explicit (elementwise) mask is needed

In DistFlashAttn (causal, P chunks), block (q_r, kv_c) is CAUSAL for c == r, FULL for c < r and
EMPTY for c > r (and a diagonal block's rows against the first half of its keys are CAUSAL too:
torch's SDPA kernels align a non-square causal mask top-left, which is exactly this); with
documents most off-diagonal blocks become EMPTY, which is where packing saves work.
Classification is pure Python arithmetic on global positions (a bisection into the document
bounds), so it never touches the device and never synchronises.

:func:`dense_mask` materialises the same rule as a boolean ``(sq, sk)`` tensor for kernels
that take an explicit mask (the reference backend, or a masked SDPA call).
"""
from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskSpec:
    """The visibility rule of one attention block, in global positions.

    Attributes:
        causal: key at global position ``kj`` is visible to query ``qi`` only if ``kj <= qi``.
        q_start: global position of the block's first query row.
        k_start: global position of the block's first key row.
        doc_bounds: global ``cu_seqlens`` as host ints ``(0, ..., N)``, or None for one
            unbounded document; a key is visible only inside the query's document.
    """

    causal: bool
    q_start: int = 0
    k_start: int = 0
    doc_bounds: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.q_start < 0 or self.k_start < 0:
            raise ValueError(f"block start positions must be >= 0, got q_start={self.q_start}, "
                             f"k_start={self.k_start}.")
        if self.doc_bounds is not None:
            if not isinstance(self.doc_bounds, tuple):
                raise TypeError("MaskSpec.doc_bounds must be a tuple of host ints; build it with "
                                "doc_bounds_from(cu_seqlens).")
            _check_bounds(self.doc_bounds)


class Relation(enum.Enum):
    """How much of a block is visible (see the module docstring)."""

    EMPTY = "empty"
    FULL = "full"
    CAUSAL = "causal"
    PARTIAL = "partial"


def _check_bounds(bounds: tuple[int, ...]) -> None:
    if len(bounds) < 2 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least one document, "
                         f"got {list(bounds)[:8]}.")
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            raise ValueError(f"cu_seqlens must be strictly increasing (no empty documents), "
                             f"got {a} followed by {b}.")


def doc_bounds_from(cu_seqlens) -> tuple[int, ...] | None:
    """Turn ``cu_seqlens`` (tensor, list, tuple or None) into host ints, with ONE host read.

    Args:
        cu_seqlens: global document boundaries ``[0, b1, ..., N]`` (int tensor on any device,
            or a sequence of ints), or None.

    Returns:
        A tuple of Python ints, or None when ``cu_seqlens`` is None.

    Raises:
        ValueError: if the bounds are not 1-D, do not start at 0, or do not strictly increase.
    """
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got shape "
                             f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}.")
        bounds = tuple(int(x) for x in cu_seqlens.tolist())  # the one host read
    else:
        bounds = tuple(int(x) for x in cu_seqlens)
    _check_bounds(bounds)
    return bounds


def _doc_of(bounds: tuple[int, ...], pos: int) -> int:
    """Index of the document holding global position ``pos``."""
    return bisect.bisect_right(bounds, pos) - 1


def _classify_documents(spec: MaskSpec, sq: int, sk: int) -> Relation:
    bounds = spec.doc_bounds
    q0, q1, k0, k1 = spec.q_start, spec.q_start + sq - 1, spec.k_start, spec.k_start + sk - 1
    if max(q1, k1) >= bounds[-1]:
        raise ValueError(f"block reaches position {max(q1, k1)} but cu_seqlens ends at "
                         f"{bounds[-1]}; the documents must cover the whole sequence.")
    dq0, dq1, dk0, dk1 = (_doc_of(bounds, p) for p in (q0, q1, k0, k1))
    lo, hi = max(dq0, dk0), min(dq1, dk1)  # documents present on both sides
    if lo > hi:
        return Relation.EMPTY
    if spec.causal and hi - lo < 2:
        # Documents strictly between lo and hi lie whole on both sides, so they always see
        # their own diagonal. Otherwise check the end documents: the earliest key of a
        # document must not come after its latest query.
        if not any(max(k0, bounds[d]) <= min(q1, bounds[d + 1] - 1) for d in {lo, hi}):
            return Relation.EMPTY
    one_doc = dq0 == dq1 == dk0 == dk1
    if one_doc and (not spec.causal or k1 <= q0):
        return Relation.FULL
    if spec.causal and q0 == k0 and dq0 == dq1:  # keys after q1 are never visible anyway
        return Relation.CAUSAL
    return Relation.PARTIAL


def classify(spec: MaskSpec, sq: int, sk: int) -> Relation:
    """Sort a block of ``sq`` queries by ``sk`` keys into EMPTY / FULL / CAUSAL / PARTIAL.

    Pure host arithmetic (no device access). FULL wins over CAUSAL where both hold (a
    single query and key at the same position).

    Args:
        spec: the block's visibility rule in global positions.
        sq: number of query rows of the block.
        sk: number of key rows of the block.

    Returns:
        The block's :class:`Relation`.

    Raises:
        ValueError: if the block reaches beyond the end of ``spec.doc_bounds``.
    """
    if sq <= 0 or sk <= 0:
        return Relation.EMPTY
    if spec.doc_bounds is not None:
        return _classify_documents(spec, sq, sk)
    if not spec.causal:
        return Relation.FULL
    q0, q1, k0, k1 = spec.q_start, spec.q_start + sq - 1, spec.k_start, spec.k_start + sk - 1
    if k0 > q1:
        return Relation.EMPTY
    if k1 <= q0:
        return Relation.FULL
    if q0 == k0:
        return Relation.CAUSAL
    return Relation.PARTIAL


def dense_mask(spec: MaskSpec, sq: int, sk: int, device=None) -> torch.Tensor | None:
    """The block's visibility as a boolean ``(sq, sk)`` tensor (True = visible).

    Args:
        spec: the block's visibility rule in global positions.
        sq: number of query rows.
        sk: number of key rows.
        device: where to build the mask.

    Returns:
        A bool tensor ``(sq, sk)``, or None when the block is FULL (no mask needed).
    """
    if classify(spec, sq, sk) is Relation.FULL:
        return None
    qpos = torch.arange(spec.q_start, spec.q_start + sq, device=device)  # (sq,)
    kpos = torch.arange(spec.k_start, spec.k_start + sk, device=device)  # (sk,)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)  # (sq, sk)
    if spec.causal:
        mask &= kpos[None, :] <= qpos[:, None]
    if spec.doc_bounds is not None:
        bounds = torch.tensor(spec.doc_bounds, device=device)
        qdoc = torch.bucketize(qpos, bounds, right=True)  # (sq,) document index + 1
        kdoc = torch.bucketize(kpos, bounds, right=True)  # (sk,)
        mask &= qdoc[:, None] == kdoc[None, :]
    return mask
