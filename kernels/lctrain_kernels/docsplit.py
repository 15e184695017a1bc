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

Only the document holding the block's first query can need both parts (:func:`pieces`); most
documents are one causal SQUARE (as many keys as rows, on the diagonal).

:func:`split_block` turns the documents into a plan of kernel calls, choosing for each
document what :mod:`lctrain_kernels.docsplit_cost` prices cheapest:

* **masked** — the masked kernel (Triton) with the block's own mask. Such documents share
  calls: consecutive ones one call over the rows they span (the kernel skips the tiles
  outside each document), or all of them gathered into ONE call (:class:`PackedCall`: their
  rows copied into a packed batch with their own document bounds, results scattered back).
* **dense, cut down** — the largest ``sq`` of the shape ladder (``shape_steps`` values per
  octave, :func:`ladder_down`) runs dense on a view of the block; the rows left over (fewer
  than one step) join the masked calls with all of their document's keys. They share no row
  with the dense square, so nothing is merged — only their keys' gradients add up.
* **dense, padded up** — a causal square of ``M = ladder_up(n)`` rows from the document's
  first row: rows ``n..M`` belong to the next document, but causal rows see only keys before
  them, so the first ``n`` rows are exact and the rest is dropped (the backward gives them
  lse = +inf, so they move no gradient). One call, no remainder, about ``(M² - n²) / 2``
  wasted pairs.
* **dense, gathered** — padded-up squares of the same ``M`` anywhere in the block, copied
  into one ``(n, M, H, D)`` batch: one call for many documents, at the price of the copies.

Documents shorter than ``min_dense`` always run masked. Adjacent documents of one exact
ladder size that run dense share one batched view call (``64x1k``: one call), and are priced
so. The batch of a dense call is itself on a ladder (1, 2, 3, 4, 6, 8, 12, ...), since cuDNN
builds an execution plan per input SHAPE, far slower than running it, and every step of real
data brings new lengths: the ladders keep the shapes few, so its cache fills within a few
steps. Pieces that are not squares (the first document of a distributed block, a document
whose keys end inside the block) run cut down in both dimensions, the keys cut off on the
masked kernel for the same rows (merged through the lse).

Finally the whole plan is priced against one masked call for the whole block, and the
cheaper runs. Everything is host arithmetic on positions and ``doc_bounds`` (host ints),
cached per block; positions in the plan are local to the block (row 0 its first query / key).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from lctrain_kernels.docsplit_cost import GPU_MODEL, CostModel
from lctrain_kernels.docsplit_docs import (Doc, Masked, MaskedCall, Option, dense_rows,
                                           down_option, ladder_down, ladder_up, masked_option,
                                           up_option)
from lctrain_kernels.masks import MaskSpec
from lctrain_kernels.pieces import Piece, causal_pairs, document_pieces, pieces

__all__ = ["BATCH_STEPS", "MIN_DENSE", "MIN_DENSE_CPU", "SHAPE_STEPS", "DenseCall", "Layout",
           "MaskedCall", "PackedCall", "Piece", "Split", "batch_sizes", "call_ranges",
           "dense_rows", "ladder_down", "ladder_up", "layout", "pieces", "split_block"]

#: dense pieces have at least this many query rows; shorter documents run masked.
MIN_DENSE = 256
#: the same on a CPU (tests and CPU runs: any size is worth the dense op there).
MIN_DENSE_CPU = 16
#: dense row counts come from a ladder of this many steps per octave (0: exact lengths).
SHAPE_STEPS = 8
#: batch sizes of dense calls come from a ladder of this many steps per octave.
BATCH_STEPS = 2


@dataclass(frozen=True)
class DenseCall:
    """One batched dense call of ``n`` entries, each ``sq`` query rows by ``sk`` keys (FULL,
    or causal from the top-left). Entry ``i`` reads rows ``[q0[i], q0[i] + sq)`` and keys
    ``[k0[i], k0[i] + sk)``; only its first ``rows[i]`` rows (and, causal, as many keys) are
    real — fewer than ``sq`` on a padded square, whose other rows are dropped. ``gather``:
    the entries are copied into the batch (an index gather); otherwise they are views of the
    block (one entry, or ``n`` adjacent unpadded ones)."""

    sq: int
    sk: int
    causal: bool
    q0: tuple[int, ...]
    k0: tuple[int, ...]
    rows: tuple[int, ...]
    gather: bool = False

    @property
    def n(self) -> int:
        """Entries of the batch."""
        return len(self.q0)

    def keys(self, i: int) -> int:
        """Real keys of entry ``i``."""
        return min(self.rows[i], self.sk) if self.causal else self.sk

    @property
    def padded(self) -> bool:
        """Whether some entry has fewer real rows than ``sq``."""
        return any(r < self.sq for r in self.rows)


@dataclass(frozen=True)
class PackedCall:
    """Whole documents (squares: ``n[i]`` rows from ``q0[i]`` against as many keys from
    ``k0[i]``) gathered into one masked call with bounds ``(0, n[0], n[0] + n[1], ...)``."""

    q0: tuple[int, ...]
    k0: tuple[int, ...]
    n: tuple[int, ...]

    @property
    def bounds(self) -> tuple[int, ...]:
        """Document bounds of the packed batch."""
        out = [0]
        for n in self.n:
            out.append(out[-1] + n)
        return tuple(out)


@dataclass(frozen=True)
class Split:
    """The kernel calls that compute one block. Rows that no call reaches see no key.

    ``cost_us`` is the model's price of this plan, ``masked_cost_us`` that of one masked call
    for the whole block (equal when that is the plan)."""

    dense: tuple[DenseCall, ...]
    masked: tuple[MaskedCall, ...]
    packed: PackedCall | None
    dense_pairs: int  # visible pairs computed by the dense calls
    pairs: int  # visible pairs of the whole block
    cost_us: float = 0.0
    masked_cost_us: float = 0.0


def batch_sizes(n: int, steps: int = BATCH_STEPS) -> list[int]:
    """``n`` entries cut into batches whose sizes are on the ladder, largest first."""
    out = []
    while n > 0:
        out.append(ladder_down(n, steps))
        n -= out[-1]
    return out


@dataclass(frozen=True)
class _Ctx:
    """What one plan is built for."""

    sq: int
    sk: int
    min_dense: int
    steps: int
    model: CostModel
    work: int
    force: bool


def _exact_runs(options: list[Option | None]) -> list[list[int]]:
    """Runs (indices) of consecutive options that are each one unpadded entry of the same
    shape right after the previous one: such documents share one batched view call."""
    runs: list[list[int]] = []
    for i, option in enumerate(options):
        e = option.single_exact() if option is not None else None
        last = runs[-1][-1] if runs else None
        p = options[last].single_exact() if last == i - 1 and options[last] else None
        if (e is not None and p is not None and (p.sq, p.sk, p.causal) == (e.sq, e.sk, e.causal)
                and e.q0 == p.q0 + p.sq and e.k0 == p.k0 + p.sk):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _choose(docs: list[Doc], ctx: _Ctx) -> list[Option]:
    """The cheapest option of each document, ignoring gathered calls it could join; cut-down
    documents in a run of equal neighbours share their call's fixed cost."""
    downs = [down_option(d, ctx) for d in docs]
    for run in _exact_runs(downs):
        if len(run) > 1:
            share = ctx.model.dense_call_us * (1 - len(batch_sizes(len(run))) / len(run))
            for i in run:
                downs[i] = replace(downs[i], cost=downs[i].cost - share)
    chosen = []
    for doc, down in zip(docs, downs):
        options = [o for o in (down, up_option(doc, ctx)) if o is not None]
        if not options or not ctx.force:
            options.append(masked_option(doc, ctx))
        chosen.append(min(options, key=lambda o: o.cost))
    return chosen


def _group_docs(docs: list[Doc], chosen: list[Option], ctx: _Ctx) -> dict[int, list[int]]:
    """Padded squares of one size ``M`` worth gathering into batched calls: M -> documents.

    Each candidate saves ``its chosen cost - its share of a gathered call``; the best prefix
    of candidates by saving is taken when the savings beat the calls' fixed costs."""
    m = ctx.model
    in_run = {i for run in _exact_runs(chosen) if len(run) > 1 for i in run}
    by_size: dict[int, list[tuple[float, int]]] = {}
    for i, doc in enumerate(docs):
        if i in in_run or not doc.paddable or doc.rows < ctx.min_dense:
            continue
        size = ladder_up(doc.rows, ctx.steps)
        share = (m.dense_us(size * (size + 1) // 2, size, ctx.work) - m.dense_call_us
                 + m.gather_us(size, ctx.work) - m.gather_call_us)
        saving = chosen[i].cost - share
        if saving > 0:
            by_size.setdefault(size, []).append((saving, i))
    groups = {}
    for size, cands in by_size.items():
        cands.sort(reverse=True)
        best, take, total = 0.0, 0, 0.0
        for count, (saving, _) in enumerate(cands, 1):
            total += saving
            fixed = len(batch_sizes(count)) * (m.dense_call_us + m.gather_call_us)
            if total - fixed > best:
                best, take = total - fixed, count
        if take:
            groups[size] = sorted(i for _, i in cands[:take])
    return groups


def _dense_calls(docs, chosen, groups, ctx: _Ctx) -> tuple[list[DenseCall], float]:
    """The dense calls of the chosen options and groups, and their price."""
    m, calls, cost = ctx.model, [], 0.0
    grouped = {i for members in groups.values() for i in members}
    for run in _exact_runs(chosen):
        if run[0] in grouped:
            continue
        if len(run) > 1:
            e, start = chosen[run[0]].entries[0], 0
            for size in batch_sizes(len(run)):
                items = [chosen[i].entries[0] for i in run[start:start + size]]
                calls.append(DenseCall(e.sq, e.sk, e.causal, tuple(x.q0 for x in items),
                                       tuple(x.k0 for x in items), (e.sq,) * size))
                start += size
            continue
        for e in chosen[run[0]].entries:
            calls.append(DenseCall(e.sq, e.sk, e.causal, (e.q0,), (e.k0,), (e.rows,)))
    for size, members in sorted(groups.items()):
        start = 0
        for count in batch_sizes(len(members)):
            part = [docs[i] for i in members[start:start + count]]
            calls.append(DenseCall(size, size, True, tuple(d.q0 for d in part),
                                   tuple(d.k0 for d in part), tuple(d.rows for d in part),
                                   gather=True))
            start += count
    for c in calls:
        computed = c.n * (causal_pairs(0, c.sq, 0, c.sk) if c.causal else c.sq * c.sk)
        cost += m.dense_us(computed, c.n * c.sq, ctx.work)
        if c.gather:
            cost += m.gather_us(c.n * c.sq, ctx.work)
    return calls, cost


def _masked_calls(docs, chosen, grouped: set, ctx: _Ctx, pack: bool):
    """(in-place masked calls, packed call or None, price) for the documents left to the
    masked kernel, the rows cut off the dense ones, and keys cut off their pieces."""
    m = ctx.model
    calls: list[Masked] = []
    pending: Masked | None = None  # consecutive masked rows, joined
    packed: list[Doc] = []
    for i, (doc, option) in enumerate(zip(docs, chosen)):
        if i not in grouped and not option.entries:  # the whole document runs masked
            if pack and doc.packable:
                packed.append(doc)
                if pending is not None:
                    calls.append(pending)
                    pending = None
                continue
            pending = option.rest if pending is None else pending.join(option.rest)
            continue
        if pending is not None:
            calls.append(pending)
            pending = None
        if i in grouped:
            continue
        calls += option.merging
        pending = option.rest
    if pending is not None:
        calls.append(pending)
    if len(packed) < 2:  # packing one document gains nothing over running it in place
        return None if pack else (calls, None, sum(
            m.masked_us(c.pairs, c.rows, ctx.work) for c in calls))
    rows = sum(d.rows for d in packed)
    cost = (m.masked_us(sum(d.pairs for d in packed), rows, ctx.work) + m.gather_us(rows, ctx.work)
            + sum(m.masked_us(c.pairs, c.rows, ctx.work) for c in calls))
    return calls, PackedCall(tuple(d.q0 for d in packed), tuple(d.k0 for d in packed),
                             tuple(d.rows for d in packed)), cost


@functools.lru_cache(maxsize=1024)
def split_block(spec: MaskSpec, sq: int, sk: int, min_dense: int = MIN_DENSE,
                shape_steps: int = SHAPE_STEPS, model: CostModel = GPU_MODEL, work: int = 4096,
                force_dense: bool = False) -> Split:
    """The plan of dense and masked calls for one block (see the module docstring).

    Args:
        spec: the block's mask in global positions.
        sq: query rows of the block.
        sk: key rows of the block.
        min_dense: fewest query (and key) rows of a dense piece.
        shape_steps: dense row counts per octave (0: exact document lengths).
        model: the prices of calls and FLOPs (:mod:`lctrain_kernels.docsplit_cost`).
        work: batch x query heads x head dim of the block's tensors.
        force_dense: run every document of ``min_dense`` rows or more dense and never fall
            back to one masked call (for measuring what the model avoids).

    Returns:
        A :class:`Split`. Masked calls use the block's mask shifted to their first row; a
        row is computed by several calls only where a piece's keys were cut (merged by lse).

    Raises:
        ValueError: if the block reaches beyond the end of ``spec.doc_bounds``.
    """
    ctx = _Ctx(sq, sk, min_dense, shape_steps, model, work, force_dense)
    docs = [Doc(spec, p) for p in document_pieces(spec, sq, sk)]
    pairs = sum(d.pairs for d in docs)
    alone = model.masked_us(pairs, sum(d.rows for d in docs), work)
    whole = Split((), (MaskedCall(0, sq, 0, sk),), None, 0, pairs, alone, alone)
    chosen = _choose(docs, ctx)
    groups = _group_docs(docs, chosen, ctx)
    dense, dense_cost = _dense_calls(docs, chosen, groups, ctx)
    if not dense:
        return whole
    grouped = {i for members in groups.values() for i in members}
    variants = [v for v in (_masked_calls(docs, chosen, grouped, ctx, pack)
                            for pack in (False, True)) if v is not None]
    masked, packed, masked_cost = min(variants, key=lambda v: v[2])
    cost = dense_cost + masked_cost
    if cost >= whole.cost_us and not force_dense:
        return whole
    dense_pairs = sum(Piece(0, 0, c.rows[i], c.keys(i), c.causal).pairs
                      for c in dense for i in range(c.n))
    return Split(tuple(dense), tuple(c.call for c in masked), packed, dense_pairs, pairs, cost,
                 whole.cost_us)


@dataclass(frozen=True)
class Layout:
    """How a plan's results fill the block's result, per side (query rows: out, lse, dq; key
    rows: dk, dv). Calls are numbered dense first, then masked, then the packed one."""

    shared_q: frozenset[int]  # calls with a query row that another call also computes
    shared_k: frozenset[int]  # calls with a key row that another call also computes
    free_q: tuple[tuple[int, int], ...]  # query rows no call computes
    free_k: tuple[tuple[int, int], ...]  # key rows no call computes
    whole: bool  # one unpadded view call computes every row and key: its result is the block's


def call_ranges(split: Split) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """Per call (numbered as in :class:`Layout`), the query and key rows it computes."""
    out = [([(c.q0[i], c.q0[i] + c.rows[i]) for i in range(c.n)],
            [(c.k0[i], c.k0[i] + c.keys(i)) for i in range(c.n)]) for c in split.dense]
    out += [([(c.q0, c.q1)], [(c.k0, c.k1)]) for c in split.masked]
    if split.packed is not None:
        p = split.packed
        out.append(([(a, a + n) for a, n in zip(p.q0, p.n)],
                    [(a, a + n) for a, n in zip(p.k0, p.n)]))
    return out


def _sharing(ranges: list[list[tuple[int, int]]], n: int):
    """(calls sharing a row with another call, rows of [0, n) no call has) for one side."""
    items = sorted((a, b, i) for i, rs in enumerate(ranges) for a, b in rs if b > a)
    shared: set[int] = set()
    for j, (a, b, i) in enumerate(items):
        for a2, _, i2 in items[j + 1:]:
            if a2 >= b:
                break
            if i2 != i:
                shared |= {i, i2}
    free, pos = [], 0
    for a, b, _ in items:
        if a > pos:
            free.append((pos, a))
        pos = max(pos, b)
    if pos < n:
        free.append((pos, n))
    return frozenset(shared), tuple(free)


@functools.lru_cache(maxsize=1024)
def layout(split: Split, sq: int, sk: int) -> Layout:
    """The :class:`Layout` of a block's plan.

    Args:
        split: the plan of a block of ``sq`` query rows and ``sk`` key rows.
        sq: query rows of the block.
        sk: key rows of the block.

    Returns:
        Which calls share rows (combined once at the end) and which rows no call computes.
    """
    ranges = call_ranges(split)
    shared_q, free_q = _sharing([r[0] for r in ranges], sq)
    shared_k, free_k = _sharing([r[1] for r in ranges], sk)
    c = split.dense[0] if len(ranges) == 1 and split.dense else None
    whole = (c is not None and not c.gather and not c.padded and c.q0[0] == 0 == c.k0[0]
             and c.n * c.sq == sq and c.n * c.sk == sk)
    return Layout(shared_q, shared_k, free_q, free_k, whole)
