"""One document of a block: its exact dense pieces, the shape ladder, and the ways to run it.

The block-level plan (:mod:`lctrain_kernels.docsplit`) is built from these: the block's dense
pieces (:mod:`lctrain_kernels.pieces`), :func:`ladder_down` / :func:`ladder_up` keep dense shapes few, and for each
document :func:`down_option`, :func:`up_option` and :func:`masked_option` say which calls it
would take and what they cost (:mod:`lctrain_kernels.docsplit_cost`). All host ints; all
positions local to the block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from lctrain_kernels.masks import MaskSpec
from lctrain_kernels.pieces import Piece, causal_pairs


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
