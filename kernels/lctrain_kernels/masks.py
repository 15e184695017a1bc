"""Which (query, key) pairs of an attention block are visible, decided on the host up front.

A block is the queries at global positions ``q_start .. q_start + sq - 1`` against the keys at
``k_start .. k_start + sk - 1``. Query ``i`` sees key ``j`` if ``j <= i`` (causal) and both lie
in the same document of ``doc_bounds`` (the global ``cu_seqlens`` as host ints). Before any
launch or send, :func:`classify` sorts a block into::

    EMPTY    nothing visible           -> skipped (no launch, no communication)
    FULL     everything visible        -> plain non-causal attention
    CAUSAL   the lower triangle from the top-left corner (q_start == k_start, one document)
    PARTIAL  anything else             -> an elementwise mask"""
from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskSpec:
    """The visibility rule of one block in global positions: ``causal``, the first query and
    key positions, and the document bounds ``(0, ..., N)`` (None: one document)."""

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
    """How much of a block is visible (module docstring)."""

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
    """``cu_seqlens`` (int tensor on any device, a sequence of ints, or None) as host ints,
    with one host read; ValueError unless 1-D, from 0 and strictly increasing."""
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


def classify(spec: MaskSpec, sq: int, sk: int) -> Relation:
    """The :class:`Relation` of a block of ``sq`` queries by ``sk`` keys (FULL wins over CAUSAL
    where both hold); ValueError if it reaches beyond the end of ``spec.doc_bounds``."""
    if sq <= 0 or sk <= 0:
        return Relation.EMPTY
    q0, q1, k0, k1 = spec.q_start, spec.q_start + sq - 1, spec.k_start, spec.k_start + sk - 1
    bounds = spec.doc_bounds or (0, max(q1, k1) + 1)  # no documents: one that holds the block
    if max(q1, k1) >= bounds[-1]:
        raise ValueError(f"block reaches position {max(q1, k1)} but cu_seqlens ends at "
                         f"{bounds[-1]}; the documents must cover the whole sequence.")
    dq0, dq1, dk0, dk1 = (bisect.bisect_right(bounds, p) - 1 for p in (q0, q1, k0, k1))
    lo, hi = max(dq0, dk0), min(dq1, dk1)  # documents present on both sides
    if lo > hi:
        return Relation.EMPTY
    if spec.causal and hi - lo < 2:
        # documents strictly between lo and hi see their own diagonal; the end ones must have
        # a key no later than their last query
        if not any(max(k0, bounds[d]) <= min(q1, bounds[d + 1] - 1) for d in {lo, hi}):
            return Relation.EMPTY
    one_doc = dq0 == dq1 == dk0 == dk1
    if one_doc and (not spec.causal or k1 <= q0):
        return Relation.FULL
    if spec.causal and q0 == k0 and dq0 == dq1:  # keys after q1 are never visible anyway
        return Relation.CAUSAL
    return Relation.PARTIAL


def dense_mask(spec: MaskSpec, sq: int, sk: int, device=None) -> torch.Tensor | None:
    """The block's visibility as a boolean ``(sq, sk)`` tensor, or None for a FULL block."""
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
