"""A block's mask as dense pieces: FULL rectangles and top-left causal triangles.

Inside one document, causal attention between a block's query rows and key rows is at most
two dense shapes: the keys before the document's first query row are all visible (a FULL
rectangle), and the keys from that row on form the lower triangle from the top-left corner
(CAUSAL). :func:`pieces` cuts a block into these, one or two per document that both sides
reach; the union of the pieces is exactly the block's mask and no pair is in two pieces. The
ragged backends run one batch entry per piece (:mod:`lctrain_kernels.ragged`). All host ints;
all positions local to the block.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from lctrain_kernels.masks import MaskSpec


@dataclass(frozen=True)
class Piece:
    """One dense sub-block: query rows ``[q0, q0 + sq)`` against key rows ``[k0, k0 + sk)``,
    all visible (``causal=False``) or the top-left causal triangle (``causal=True``)."""

    q0: int
    k0: int
    sq: int
    sk: int
    causal: bool


def _doc_regions(spec: MaskSpec, sq: int, sk: int):
    """Yield (qa, qb, ka, kb), global positions, for each document both sides of a block reach."""
    q0, q1, k0, k1 = spec.q_start, spec.q_start + sq, spec.k_start, spec.k_start + sk
    bounds = spec.doc_bounds if spec.doc_bounds is not None else (0, max(q1, k1))
    if max(q1, k1) > bounds[-1]:
        raise ValueError(f"block reaches position {max(q1, k1) - 1} but cu_seqlens ends at "
                         f"{bounds[-1]}; the documents must cover the whole sequence.")
    doc = lambda pos: bisect.bisect_right(bounds, pos) - 1  # noqa: E731 - document of pos
    for d in range(max(doc(q0), doc(k0)), min(doc(q1 - 1), doc(k1 - 1)) + 1):
        yield (max(q0, bounds[d]), min(q1, bounds[d + 1]),
               max(k0, bounds[d]), min(k1, bounds[d + 1]))


def document_pieces(spec: MaskSpec, sq: int, sk: int):
    """Yield, per document with a visible pair, its pieces (one, or FULL + CAUSAL of the same
    rows), in block-local rows."""
    if sq <= 0 or sk <= 0:
        return
    for qa, qb, ka, kb in _doc_regions(spec, sq, sk):
        dq, dk = spec.q_start, spec.k_start
        if not spec.causal:
            yield (Piece(qa - dq, ka - dk, qb - qa, kb - ka, False),)
            continue
        r0 = max(qa, ka)  # query rows before the document's first key see nothing
        if r0 >= qb:
            continue
        kb = min(kb, qb)  # keys after the last query are never seen
        parts = []
        if ka < r0:  # keys before every query: all visible
            parts.append(Piece(r0 - dq, ka - dk, qb - r0, min(r0, kb) - ka, False))
        if kb > r0:  # keys from the first query on: the triangle from the top-left corner
            parts.append(Piece(r0 - dq, r0 - dk, qb - r0, kb - r0, True))
        yield tuple(parts)


def pieces(spec: MaskSpec, sq: int, sk: int) -> tuple[Piece, ...]:
    """The exact dense decomposition of a block: disjoint pieces whose union is its mask.

    Args:
        spec: the block's mask in global positions.
        sq: query rows of the block.
        sk: key rows of the block.

    Returns:
        Pieces in block-local rows, ordered by document; at most one document (the one
        holding the first query) has both a FULL and a CAUSAL piece (same rows).

    Raises:
        ValueError: if the block reaches beyond the end of ``spec.doc_bounds``.
    """
    return tuple(p for doc in document_pieces(spec, sq, sk) for p in doc)
