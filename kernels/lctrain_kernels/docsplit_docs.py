"""One document of a block: its exact dense pieces, the shape ladder, and the ways to run it.

The block-level plan (:mod:`lctrain_kernels.docsplit`) is built from these: :func:`pieces`
cuts the block's mask into FULL rectangles and top-left causal triangles (module docstring of
``docsplit``), :func:`ladder_down` / :func:`ladder_up` keep dense shapes few, and for each
document :func:`down_option`, :func:`up_option` and :func:`masked_option` say which calls it
would take and what they cost (:mod:`lctrain_kernels.docsplit_cost`). All host ints; all
positions local to the block.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

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

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs of the piece."""
        return self.visible(0, self.sq, 0, self.sk)

    def visible(self, r0: int, r1: int, c0: int, c1: int) -> int:
        """Visible pairs in its rows ``[r0, r1)`` and keys ``[c0, c1)`` (piece-local)."""
        r0, r1, c0, c1 = max(r0, 0), min(r1, self.sq), max(c0, 0), min(c1, self.sk)
        if r0 >= r1 or c0 >= c1:
            return 0
        return causal_pairs(r0, r1, c0, c1) if self.causal else (r1 - r0) * (c1 - c0)


def causal_pairs(r0: int, r1: int, c0: int, c1: int) -> int:
    """Pairs (row t, key j) with ``r0 <= t < r1``, ``c0 <= j < c1`` and ``j <= t``."""
    total = 0
    a, b = max(r0, c0), min(r1, c1 - 1)  # rows whose count t + 1 - c0 still grows
    if a < b:
        total += (b - a) * (1 - c0) + (a + b - 1) * (b - a) // 2
    full = max(r0, c1 - 1, c0)  # rows from here on see all of [c0, c1)
    if full < r1 and c1 > c0:
        total += (r1 - full) * (c1 - c0)
    return total


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


def _step(n: int, steps: int) -> int:
    return max(1, (1 << (n.bit_length() - 1)) // steps)


def ladder_down(n: int, steps: int) -> int:
    """The largest ladder value ``<= n`` (``n >= 1``): multiples of ``2**floor(log2 n) //
    steps`` (at least 1), so at most ``steps`` values per octave; ``steps=0``: ``n``."""
    if steps <= 0:
        return n
    step = _step(n, steps)
    return n // step * step


def ladder_up(n: int, steps: int) -> int:
    """The smallest ladder value ``>= n`` (``n >= 1``; a power of two closes each octave)."""
    if steps <= 0:
        return n
    step = _step(n, steps)
    return -(-n // step) * step


def dense_rows(n: int, min_dense: int, shape_steps: int) -> int:
    """Rows of an ``n``-row piece that run dense cut down: :func:`ladder_down`, or 0 when
    that is fewer than ``min_dense``."""
    if n < max(min_dense, 1):
        return 0
    m = ladder_down(n, shape_steps)
    return m if m >= min_dense else 0


@dataclass(frozen=True)
class MaskedCall:
    """Query rows ``[q0, q1)`` against key rows ``[k0, k1)`` under the block's own mask."""

    q0: int
    q1: int
    k0: int
    k1: int


@dataclass(frozen=True)
class Masked:
    """A masked call while planning, with the visible pairs and rows it prices."""

    call: MaskedCall
    pairs: int
    rows: int

    def join(self, other: Masked | None) -> Masked:
        """One call over this one's rows and the next one's (consecutive rows)."""
        if other is None:
            return self
        a, b = self.call, other.call
        return Masked(MaskedCall(a.q0, b.q1, min(a.k0, b.k0), max(a.k1, b.k1)),
                      self.pairs + other.pairs, self.rows + other.rows)


class Entry(NamedTuple):
    """One dense square or rectangle of a document: ``sq`` rows from ``q0`` by ``sk`` keys
    from ``k0``, of which the first ``rows`` rows are real (``rows < sq``: padded)."""

    sq: int
    sk: int
    causal: bool
    q0: int
    k0: int
    rows: int


@dataclass(frozen=True)
class Option:
    """A way to run one document: dense entries (views), masked calls merging into their rows
    (keys cut off), and masked rows left over (joinable with the next masked rows). No
    entries: the whole document is ``rest``."""

    cost: float
    entries: tuple[Entry, ...]
    merging: tuple[Masked, ...]
    rest: Masked | None

    def single_exact(self) -> Entry | None:
        """Its entry, if it is one unpadded entry and nothing else."""
        if len(self.entries) != 1 or self.merging or self.rest is not None:
            return None
        e = self.entries[0]
        return e if e.rows == e.sq else None


class Doc:
    """One document's pieces (which share their query rows) and what the planner asks."""

    def __init__(self, spec: MaskSpec, parts: tuple[Piece, ...]):
        self.pieces, p = parts, parts[0]
        self.q0, self.rows = p.q0, p.sq
        self.k0 = min(x.k0 for x in parts)
        self.k1 = max(x.k0 + x.sk for x in parts)
        self.pairs = sum(x.pairs for x in parts)
        square = len(parts) == 1 and p.sq == p.sk
        self.paddable = square and p.causal  # a causal square can borrow the rows after it
        self.packable = square and p.causal == spec.causal  # runs alone in a packed batch

    def whole(self) -> Masked:
        """The whole document as a masked call."""
        return Masked(MaskedCall(self.q0, self.q0 + self.rows, self.k0, self.k1), self.pairs,
                      self.rows)


def masked_option(doc: Doc, ctx) -> Option:
    """The whole document on the masked kernel; its call's fixed cost is shared, not counted."""
    return Option(ctx.model.masked_us(doc.pairs, doc.rows, ctx.work, calls=0), (), (),
                  doc.whole())


def down_option(doc: Doc, ctx) -> Option | None:
    """Rows (and keys of pieces with fewer keys than rows) cut down to the ladder; the rows
    left over, and keys cut off, on the masked kernel. None if too short."""
    m = dense_rows(doc.rows, ctx.min_dense, ctx.steps)
    if m == 0:
        return None
    model, w = ctx.model, ctx.work
    entries, merging = [], []
    for p in doc.pieces:
        seen = min(m, p.sk) if p.causal else p.sk  # head rows of a triangle see m keys at most
        sk = seen if seen == m else dense_rows(seen, ctx.min_dense, ctx.steps)  # keys: ladder
        if sk:
            entries.append(Entry(m, sk, p.causal, p.q0, p.k0, m))
        if sk < seen:  # keys left over: the masked kernel, merged into the same rows
            call = MaskedCall(doc.q0, doc.q0 + m, p.k0 + sk, p.k0 + seen)
            merging.append(Masked(call, p.visible(0, m, sk, seen), m))
    if not entries:
        return None
    rest = None
    if m < doc.rows:
        pairs = sum(p.visible(m, doc.rows, 0, p.sk) for p in doc.pieces)
        rest = Masked(MaskedCall(doc.q0 + m, doc.q0 + doc.rows, doc.k0, doc.k1), pairs,
                      doc.rows - m)
    cost = sum(model.dense_us(Piece(0, 0, e.sq, e.sk, e.causal).pairs, e.sq, w) for e in entries)
    cost += sum(model.masked_us(c.pairs, c.rows, w) for c in merging)
    if rest is not None:
        cost += model.masked_us(rest.pairs, rest.rows, w)
    return Option(cost, tuple(entries), tuple(merging), rest)


def up_option(doc: Doc, ctx) -> Option | None:
    """A causal square padded up to the ladder, as a view of the rows after it: None if the
    document is no causal square, too short, already on the ladder, or the padded square
    would reach past the block."""
    if not doc.paddable or doc.rows < ctx.min_dense:
        return None
    size = ladder_up(doc.rows, ctx.steps)
    p = doc.pieces[0]
    if size == doc.rows or p.q0 + size > ctx.sq or p.k0 + size > ctx.sk:
        return None
    cost = ctx.model.dense_us(causal_pairs(0, size, 0, size), size, ctx.work)
    return Option(cost, (Entry(size, size, True, p.q0, p.k0, doc.rows),), (), None)
