"""Balancing packed documents over the ranks: an order of the documents, and where distflash splits
its shared blocks, that even out the work.

A packed row does only the pairs inside each document, and where the documents lie decides which
rank does them. Attention never crosses a document, so the documents may stand in any order with the
same losses. :func:`balanced_order` counts the visible pairs of every block of the schedule's plan
(:func:`document_work`, exact integers), starts from the given order and a few sorted ones, then
swaps documents while that lowers the busiest rank's work, within a fixed budget. Documents move
whole, so a few long ones cannot always be dealt evenly; distflash on an even number of ranks
splits its distance-P/2 blocks by query rows between two ranks, and :func:`balanced_split` moves
that split, in steps of 1/`SPLITS` of a rank's rows, to where the busiest rank does the least.
:func:`balanced_cuts` then moves each rank's cut of its diagonal block so that two ranks reach each
transfer between them after the same work. Host integers only: every rank finds the same order,
split and cuts."""
from __future__ import annotations

import functools
from fractions import Fraction

import numpy as np

from lctrain_kernels.distributed.layout import local_spans
from lctrain_kernels.distributed.schedule import ALL, HALF, Block, Rows, make_schedule

EVALUATIONS = 400  # cost evaluations a search may spend (each a few tens of microseconds)
MOVED = 8  # how many of the longest documents the swap search moves
GOOD_ENOUGH = 1.01  # the search stops once the busiest rank is within this factor of the mean
SPLITS = 64  # distflash's shared blocks split their query rows at a multiple of 1/SPLITS
MOVE = 4  # a cut moved from the half costs this fraction of the work it moves to the first step


def _block_regions(seq_len: int, world_size: int, layout: str, b: Block) -> list[tuple]:
    """``(rank, qa, qb, ka, kb)``, global query and key ranges, of each region of block ``b``."""
    n = seq_len // world_size
    qs = local_spans(seq_len, world_size, b.q_owner, layout, *b.q_rows.resolve(n))
    ks = local_spans(seq_len, world_size, b.kv_owner, layout, *b.kv_rows.resolve(n))
    return [(b.rank, q0, q0 + ql, k0, k0 + kl) for _, q0, ql in qs for _, k0, kl in ks]


def _columns(rows: list[tuple]) -> tuple[np.ndarray, ...]:
    return tuple(np.array(c, dtype=np.int64) for c in zip(*rows))


@functools.lru_cache(maxsize=64)
def _regions(seq_len: int, world_size: int, kind: str, granules: int):
    """The global query and key ranges of the schedule's causal forward plan: ``cols``, arrays
    ``rank, qa, qb, ka, kb`` with first one entry per region of every block that is not split,
    then the regions of distflash's split blocks cut into ``granules`` runs of query rows;
    ``fixed``, how many come first; ``granule``, the (pair × granules + run) of each later one;
    ``pairs``, the (rank before the split, rank after it) of each pair of split blocks."""
    schedule = make_schedule(world_size, kind)
    rows, pairs = [], []
    for step in schedule.plan("forward", True).steps:
        for b in step.blocks:
            if b.q_owner != b.kv_owner and b.q_rows != ALL:  # a split block: granules below
                if b.rank == b.q_owner:
                    pairs.append((b.rank, b.kv_owner))
                continue
            rows += _block_regions(seq_len, world_size, schedule.layout, b)
    fixed, granule = len(rows), []
    for i, (head, tail) in enumerate(pairs):  # head owns the queries, computes those before
        for g in range(granules):
            run = Rows(Fraction(g, granules), Fraction(g + 1, granules))
            got = _block_regions(seq_len, world_size, schedule.layout,
                                 Block(head, head, run, tail, ALL))
            rows += got
            granule += [i * granules + g] * len(got)
    return _columns(rows), fixed, np.array(granule, dtype=np.int64), tuple(pairs)


def _visible(cols: tuple[np.ndarray, ...], lengths: np.ndarray) -> np.ndarray:
    """Visible causal pairs of every region for documents of ``lengths`` in that order."""
    _, qa0, qb0, ka0, kb0 = (c[:, None] for c in cols)
    ends = np.cumsum(lengths)[None, :]
    starts = ends - lengths[None, :]
    qa, qb = np.maximum(qa0, starts), np.minimum(qb0, ends)
    ka, kb = np.maximum(ka0, starts), np.minimum(kb0, ends)
    u, w = np.maximum(qa, ka), np.minimum(qb, kb)  # rows that see part of the keys
    part = np.where(w > u, (w - u) * (u + w + 1 - 2 * ka) // 2, 0)
    whole = np.maximum(qb - np.maximum(qa, kb), 0) * (kb - ka)  # rows that see every key
    # float64 sums of integers below 2**53 are exact
    return np.where((qa < qb) & (ka < kb), part + whole, 0).sum(axis=1)


def _split_work(seq_len: int, world_size: int, kind: str, lengths: np.ndarray,
                granules: int = SPLITS) -> np.ndarray:
    """Work per rank (columns) for each split (rows: 1/granules .. (granules-1)/granules, or the
    one row of a schedule that splits nothing), for documents of ``lengths`` in that order."""
    cols, fixed, granule, pairs = _regions(seq_len, world_size, kind, granules)
    got = _visible(cols, lengths)
    base = np.bincount(cols[0][:fixed], weights=got[:fixed], minlength=world_size)
    if not pairs:
        return base[None, :]
    per = np.bincount(granule, weights=got[fixed:], minlength=len(pairs) * granules)
    work = np.repeat(base[None, :], granules - 1, axis=0)
    for i, (head, tail) in enumerate(pairs):
        before = np.cumsum(per[i * granules:(i + 1) * granules])  # rows before each split
        work[:, head] += before[:-1]
        work[:, tail] += before[-1] - before[:-1]
    return work


def _best(work: np.ndarray) -> int:
    """The row of ``_split_work`` whose busiest rank does the least; ties: nearest the half."""
    busiest = work.max(axis=1)
    middle = (len(busiest) - 1) / 2
    return int(min(range(len(busiest)), key=lambda i: (busiest[i], abs(i - middle))))


def balanced_split(lengths, seq_len: int, world_size: int, kind: str = "distflash") -> Fraction:
    """Where distflash splits its distance-P/2 blocks for documents of ``lengths`` (in sequence
    order): the multiple of 1/SPLITS whose busiest rank does the least work (1/2 on a tie, and
    for schedules or rank counts that split nothing)."""
    work = _split_work(seq_len, world_size, kind, _checked(lengths, seq_len))
    return HALF if len(work) == 1 else Fraction(_best(work) + 1, SPLITS)


@functools.lru_cache(maxsize=64)
def _step_regions(seq_len: int, world_size: int, kind: str, split: Fraction):
    """The regions of the causal forward plan at ``split`` as ``cols`` (arrays ``rank, qa, qb,
    ka, kb``) and the ``step`` of each; then ``first``, the regions of every rank's first step
    at each cut from 1/2 to (SPLITS-1)/SPLITS, with the ``(rank, cut index)`` of each."""
    schedule = make_schedule(world_size, kind)
    layout = schedule.layout
    rows, steps = [], []
    for k, step in enumerate(schedule.plan("forward", True, split).steps):
        for b in step.blocks:
            got = _block_regions(seq_len, world_size, layout, b)
            rows += got
            steps += [k] * len(got)
    first, which = [], []
    for i, g in enumerate(range(SPLITS // 2, SPLITS)):
        for r in range(world_size):
            got = _block_regions(seq_len, world_size, layout,
                                 Block(r, r, ALL, r, Rows(Fraction(0), Fraction(g, SPLITS))))
            first += got
            which += [r * (SPLITS // 2) + i] * len(got)
    return (_columns(rows), np.array(steps, dtype=np.int64), _columns(first),
            np.array(which, dtype=np.int64))


def balanced_cuts(lengths, seq_len: int, world_size: int, kind: str = "distflash",
                  split: Fraction = HALF) -> tuple[Fraction, ...]:
    """Where distflash cuts each rank's diagonal block (see ``schedule``) for documents of
    ``lengths`` (in sequence order) and its shared blocks split at ``split``: the multiples of
    1/SPLITS from 1/2 up that leave the least total difference between the work two ranks have
    done when they post a transfer between them (each one's share of the first step moves all
    its posts), plus 1/MOVE of the work they move out of the last step, which hides the last
    results; 1/2 for one sequence and for schedules that cut nothing."""
    half = (HALF,) * world_size
    if kind != "distflash" or world_size == 1:
        return half
    lengths = _checked(lengths, seq_len)
    plan = make_schedule(world_size, kind).plan("forward", True, split)
    cols, steps, first_cols, which = _step_regions(seq_len, world_size, kind, split)
    last = len(plan.steps)
    work = np.zeros((last, world_size))
    np.add.at(work, (steps, cols[0]), _visible(cols, lengths))
    first = np.bincount(which, weights=_visible(first_cols, lengths),
                        minlength=world_size * (SPLITS // 2)).reshape(world_size, SPLITS // 2)
    # posted once step b is done: step b's results and step b + 2's inputs
    posts = [(b, m.src, m.dst) for b in range(last - 1)
             for m in (*plan.steps[b].outputs, *(plan.steps[b + 2].inputs if b + 2 < last else ()))]
    if not posts:
        return half
    at, src, dst = (np.array(c) for c in zip(*posts))
    later = (np.cumsum(work, axis=0) - work[0])[at]  # work after the first step, at each post
    sign = np.zeros((len(posts), world_size))  # a post's gap: its source's work - its dest's
    sign[np.arange(len(posts)), src], sign[np.arange(len(posts)), dst] = 1, -1
    ranks, choice = np.arange(world_size), [0] * world_size
    for _ in range(world_size):  # every pair of ranks jointly, the others held: exact for 2
        moved = False
        for r in range(world_size):
            for t in range(r + 1, world_size):
                fixed, moves = first[ranks, choice], sign[:, [r, t]].any(axis=1)
                s = sign[moves][:, [r, t]]  # only the gaps of posts at r or t move with the pair
                held = (sign[moves] * (later[moves] + fixed)).sum(axis=1) - s @ fixed[[r, t]]
                gap = held + s[:, 0] * first[r][:, None, None] + s[:, 1] * first[t][None, :, None]
                cost = np.abs(gap).sum(axis=-1) + (
                    (first[r] - first[r, 0])[:, None] + (first[t] - first[t, 0])[None, :]) / MOVE
                a, b = np.unravel_index(int(np.argmin(cost)), cost.shape)  # first: nearest ½
                moved |= (a, b) != (choice[r], choice[t])
                choice[r], choice[t] = int(a), int(b)
        if not moved:
            break
    return tuple(Fraction(SPLITS // 2 + c, SPLITS) for c in choice)


def _checked(lengths, seq_len: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.sum() != seq_len:
        raise ValueError(f"document lengths sum to {int(lengths.sum())}, not {seq_len}")
    return lengths


def document_work(lengths, seq_len: int, world_size: int, kind: str = "distflash") -> list[int]:
    """The visible causal (query, key) pairs each rank computes under schedule ``kind``, for
    documents of ``lengths`` (in sequence order, summing to ``seq_len``), at the split
    :func:`balanced_split` chooses."""
    work = _split_work(seq_len, world_size, kind, _checked(lengths, seq_len))
    return [int(x) for x in work[_best(work)]]


def work_balance(lengths, seq_len: int, world_size: int, kind: str = "distflash") -> float:
    """The busiest rank's :func:`document_work` over the mean (1.0 is even)."""
    work = document_work(lengths, seq_len, world_size, kind)
    return max(work) * world_size / max(sum(work), 1)


def _dealt(lengths: np.ndarray, by_length: np.ndarray, seq_len: int, world_size: int,
           kind: str) -> np.ndarray:
    """Longest first, each document into the chunk whose rank has the least work so far among
    those it fits in; those that fit nowhere fill the gaps, crossing a chunk boundary."""
    layout = make_schedule(world_size, kind).layout
    owners = list(range(world_size))  # chunk -> rank; zigzag's second half runs back
    if layout == "zigzag":
        owners += owners[::-1]
    room = [seq_len // len(owners)] * len(owners)
    load = [0] * world_size
    chunks: list[list[int]] = [[] for _ in owners]
    spill = []
    for d in by_length.tolist():
        n = int(lengths[d])
        fits = [c for c in range(len(owners)) if room[c] >= n]
        if not fits:
            spill.append(d)
            continue
        c = min(fits, key=lambda c: (load[owners[c]], room[c]))
        chunks[c].append(d)
        room[c] -= n
        load[owners[c]] += n * n
    order = []
    for c, docs in enumerate(chunks):
        order += docs
        while spill and room[c] > 0:  # a spilled document starts in this chunk's gap
            order.append(spill.pop(0))
            room[c] = 0
    return np.array(order + spill, dtype=np.int64)


def balanced_order(lengths, seq_len: int, world_size: int, kind: str = "distflash",
                   evaluations: int = EVALUATIONS) -> tuple[int, ...]:
    """An order of the documents (indices into ``lengths``) whose busiest rank does the least
    work found within ``evaluations`` cost evaluations; the given order when none is better.
    The search counts the work at distflash's half split (one region per shared block); the
    orders it starts from and ends with are then compared at their best splits.
    Arguments as :func:`document_work`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    identity = tuple(range(len(lengths)))
    if world_size == 1 or len(lengths) < 2:
        return identity
    spent = 0

    def cost(order: np.ndarray) -> int:
        nonlocal spent
        spent += 1
        return int(_split_work(seq_len, world_size, kind, lengths[order], 2).max())

    total = _split_work(seq_len, world_size, kind, lengths, 2)[0].sum()
    enough = GOOD_ENOUGH * int(total) / world_size

    by_length = np.argsort(-lengths, kind="stable")
    piped = np.concatenate([by_length[0::2], by_length[1::2][::-1]])  # long ones at both ends
    starts = [np.arange(len(lengths)), _dealt(lengths, by_length, seq_len, world_size, kind),
              by_length, piped]
    scored = [(cost(o), i) for i, o in enumerate(starts)]
    best_cost, best_i = min(scored)
    best = starts[best_i].copy()
    moved = set(by_length[:MOVED].tolist())
    improved = best_cost > enough
    while improved and spent < evaluations:
        improved = False
        for i in [p for p in range(len(best)) if best[p] in moved]:
            for j in range(len(best)):
                if spent >= evaluations:
                    break
                if i == j or lengths[best[i]] == lengths[best[j]]:
                    continue
                best[i], best[j] = best[j], best[i]
                c = cost(best)
                if c < best_cost:
                    best_cost, improved = c, True
                    if best_cost <= enough:
                        spent = evaluations
                else:
                    best[i], best[j] = best[j], best[i]
    # min keeps the first of equals: the given order unless another is better
    return tuple(int(x) for x in min([*starts, best], key=lambda o: int(
        _split_work(seq_len, world_size, kind, lengths[o]).max(axis=1).min())))
