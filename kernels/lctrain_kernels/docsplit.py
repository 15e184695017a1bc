"""Cutting a document-masked block into dense sub-blocks that the fast dense kernels can run.

cuDNN's attention is the fastest kernel on a Hopper GPU but knows only two masks: none (FULL)
and a causal triangle anchored at the top-left corner (CAUSAL). A block of packed documents
(:mod:`lctrain_kernels.masks`) is neither — yet inside ONE document it is. For each document
``d`` that the block's queries and keys both reach, take its query rows ``[qa, qb)`` and key
rows ``[ka, kb)`` (global positions, clipped to the block). Without a causal mask that is one
FULL rectangle. With one, key ``j`` is visible to query ``i`` iff ``j <= i``, so::

    query rows before ka see nothing       -> trim them:  qa' = max(qa, ka)
    keys after the last query are unseen   -> trim them:  kb' = min(kb, qb)
    keys before qa' are seen by every row  -> FULL  rows [qa', qb) x keys [ka, min(qa', kb'))
    keys [qa', kb') start with the queries -> CAUSAL rows [qa', qb) x keys [qa', kb')
                                              (row i sees key rows 0..i: top-left)

A document needs both parts only where the block's keys start before its queries and reach
into them — only the document holding the block's first query can (:func:`pieces`). The two
parts cover disjoint keys of the same rows; their results merge through the log-sum-exp.

:func:`split_block` turns the pieces into a plan of kernel calls:

* **Dense calls.** Adjacent pieces of one shape and relation (``n`` equal documents in a row)
  become ONE call with the documents as its batch: a view of the block's tensors, no copy.
* **Shape steps.** cuDNN builds an execution plan for every new input shape (and keeps it),
  far slower than running it — and every step of real data brings new document lengths.
  So a dense piece keeps only the largest row count of a fixed ladder that fits (multiples
  of 1/``shape_steps`` of the power of two below): at most ``shape_steps`` shapes per
  octave. The rows cut off (a document's last few) go to the masked kernel with all of
  their keys; they are less than 1/``shape_steps`` of its rows. A piece whose keys are
  fewer than its rows (a FULL part, or keys that end inside the document) keeps a ladder
  count of keys too; the keys cut off go to the masked kernel for the same rows.
* **Masked calls.** Documents shorter than ``min_dense`` rows, and those cut-off rows, run
  on the masked kernel (Triton) with the block's own mask: consecutive ones share one call
  over the rows they span (the kernel skips the tiles outside each document). If the dense
  calls would cover less than ``min_dense_share`` of the visible pairs, the whole block is
  one masked call instead.

Everything here is host arithmetic on the block's positions and ``doc_bounds`` (host ints),
cached per block, so it never touches the device. Positions in the plan are local to the
block (row 0 is its first query / key).
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from lctrain_kernels.masks import MaskSpec

#: dense pieces have at least this many query rows; shorter documents run masked. On a GPU
#: each dense call costs a launch and, per new shape, a cuDNN plan.
MIN_DENSE = 1024
#: the same on a CPU, where the dense op has neither cost and beats the masked path at any size.
MIN_DENSE_CPU = 16
#: dense row counts come from a ladder of this many steps per octave (0: exact lengths).
SHAPE_STEPS = 32
#: below this share of the visible pairs in dense calls, the whole block runs masked.
MIN_DENSE_SHARE = 0.5


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
        if not self.causal:
            return self.sq * self.sk
        c = min(self.sq, self.sk)
        return c * (c + 1) // 2 + (self.sq - c) * self.sk


@dataclass(frozen=True)
class DenseCall:
    """``n`` pieces of one shape, adjacent in memory, run as one batched call: piece ``i``
    has query rows ``[q0 + i*sq, q0 + (i+1)*sq)`` and key rows ``[k0 + i*sk, k0 + (i+1)*sk)``."""

    q0: int
    k0: int
    sq: int
    sk: int
    n: int
    causal: bool


@dataclass(frozen=True)
class MaskedCall:
    """Query rows ``[q0, q1)`` against key rows ``[k0, k1)`` under the block's own mask."""

    q0: int
    q1: int
    k0: int
    k1: int


@dataclass(frozen=True)
class Split:
    """The kernel calls that compute one block. Rows that no call reaches see no key."""

    dense: tuple[DenseCall, ...]
    masked: tuple[MaskedCall, ...]
    dense_pairs: int  # visible pairs computed by the dense calls
    pairs: int  # visible pairs of the whole block


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


def _document_pieces(spec: MaskSpec, sq: int, sk: int):
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
    return tuple(p for doc in _document_pieces(spec, sq, sk) for p in doc)


def dense_rows(n: int, min_dense: int = MIN_DENSE, shape_steps: int = SHAPE_STEPS) -> int:
    """Rows of an ``n``-row piece that run dense: the largest ladder value <= n, 0 if too few.

    The ladder: multiples of ``max(1, 2**floor(log2 n) // shape_steps)``; with
    ``shape_steps=0``, ``n`` itself.

    Args:
        n: query rows of the piece.
        min_dense: fewer rows than this run masked (returns 0).
        shape_steps: ladder steps per octave, or 0 for exact lengths.

    Returns:
        The dense row count, a multiple of the step, in ``[min_dense, n]``, or 0.
    """
    if n < max(min_dense, 1):
        return 0
    if shape_steps <= 0:
        return n
    step = max(1, (1 << (n.bit_length() - 1)) // shape_steps)
    m = n // step * step
    return m if m >= min_dense else 0


def _join(a: MaskedCall, b: MaskedCall) -> MaskedCall:
    """One masked call over the rows and keys of two consecutive ones."""
    return MaskedCall(a.q0, b.q1, min(a.k0, b.k0), max(a.k1, b.k1))


def _batch(heads: list[Piece]) -> tuple[DenseCall, ...]:
    """Adjacent pieces of one shape and relation as batched calls, in order."""
    calls: list[DenseCall] = []
    for p in heads:
        last = calls[-1] if calls else None
        if (last is not None and (last.sq, last.sk, last.causal) == (p.sq, p.sk, p.causal)
                and p.q0 == last.q0 + last.n * last.sq and p.k0 == last.k0 + last.n * last.sk):
            calls[-1] = DenseCall(last.q0, last.k0, last.sq, last.sk, last.n + 1, last.causal)
        else:
            calls.append(DenseCall(p.q0, p.k0, p.sq, p.sk, 1, p.causal))
    return tuple(calls)


def _plan_document(doc: tuple[Piece, ...], min_dense: int, shape_steps: int):
    """(dense heads, masked calls merging into the heads' rows, masked call of the rows left)
    for one document's pieces (which share their query rows)."""
    r0, n = doc[0].q0, doc[0].sq
    keys = (min(p.k0 for p in doc), max(p.k0 + p.sk for p in doc))
    whole = MaskedCall(r0, r0 + n, *keys)
    m = dense_rows(n, min_dense, shape_steps)
    if m == 0:
        return [], [], whole
    heads, merging = [], []
    for p in doc:
        seen = min(m, p.sk) if p.causal else p.sk  # head rows of a triangle see m keys at most
        sk = seen if seen == m else dense_rows(seen, min_dense, shape_steps)  # keys: on the ladder
        if sk:
            heads.append(Piece(p.q0, p.k0, m, sk, p.causal))
        if sk < seen:  # keys left over: the masked kernel, merged into the same rows
            merging.append(MaskedCall(r0, r0 + m, p.k0 + sk, p.k0 + seen))
    if not heads:
        return [], [], whole
    rest = MaskedCall(r0 + m, r0 + n, *keys) if m < n else None
    return heads, merging, rest


@functools.lru_cache(maxsize=1024)
def split_block(spec: MaskSpec, sq: int, sk: int, min_dense: int = MIN_DENSE,
                shape_steps: int = SHAPE_STEPS, min_dense_share: float = MIN_DENSE_SHARE
                ) -> Split:
    """The plan of dense and masked calls for one block (see the module docstring).

    Args:
        spec: the block's mask in global positions.
        sq: query rows of the block.
        sk: key rows of the block.
        min_dense: fewest query (and key) rows of a dense piece.
        shape_steps: dense row counts per octave (0: exact document lengths).
        min_dense_share: below this share of the visible pairs in dense calls, one masked
            call computes the whole block.

    Returns:
        A :class:`Split`. Masked calls use the block's mask shifted to their first row; the
        dense calls' rows never overlap each other except a FULL and a CAUSAL piece of the
        same document; masked calls may share rows with dense calls (merged by lse).

    Raises:
        ValueError: if the block reaches beyond the end of ``spec.doc_bounds``.
    """
    heads: list[Piece] = []
    masked: list[MaskedCall] = []
    pending: MaskedCall | None = None  # rows no dense call reaches, joined while consecutive
    pairs = 0
    for doc in _document_pieces(spec, sq, sk):
        pairs += sum(p.pairs for p in doc)
        doc_heads, merging, rest = _plan_document(doc, min_dense, shape_steps)
        if doc_heads and pending is not None:
            masked.append(pending)
            pending = None
        heads += doc_heads
        masked += merging
        if rest is not None:
            pending = rest if pending is None else _join(pending, rest)
    if pending is not None:
        masked.append(pending)
    dense_pairs = sum(p.pairs for p in heads)
    if dense_pairs < min_dense_share * pairs:
        return Split((), (MaskedCall(0, sq, 0, sk),), 0, pairs)
    return Split(_batch(heads), tuple(masked), dense_pairs, pairs)
