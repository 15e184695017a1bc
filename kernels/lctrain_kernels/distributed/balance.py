"""Balancing packed documents over the ranks: an order of the documents that evens out the work.

A packed row does only the pairs inside each document, and where the documents lie decides which
rank does them. Attention never crosses a document, so the documents may stand in any order with the
same losses. :func:`balanced_order` counts the visible pairs of every block of the schedule's plan
(:func:`document_work`, exact integers), starts from the given order and a few sorted ones, then
swaps documents while that lowers the busiest rank's work, within a fixed budget. Host integers
only: every rank finds the same order."""
from __future__ import annotations

import functools

import numpy as np

from lctrain_kernels.distributed.layout import local_spans
from lctrain_kernels.distributed.schedule import make_schedule

EVALUATIONS = 400  # cost evaluations a search may spend (each a few tens of microseconds)
MOVED = 8  # how many of the longest documents the swap search moves
GOOD_ENOUGH = 1.01  # the search stops once the busiest rank is within this factor of the mean


@functools.lru_cache(maxsize=64)
def _regions(seq_len: int, world_size: int, kind: str) -> tuple[np.ndarray, ...]:
    """The global query and key ranges of every block of the schedule's causal forward plan,
    with the rank that computes it: arrays ``rank, qa, qb, ka, kb`` of one entry per region."""
    schedule = make_schedule(world_size, kind)
    n_local = seq_len // world_size
    rows = []
    for step in schedule.plan("forward", True).steps:
        for b in step.blocks:
            qs = local_spans(seq_len, world_size, b.q_owner, schedule.layout,
                             *b.q_rows.resolve(n_local))
            ks = local_spans(seq_len, world_size, b.kv_owner, schedule.layout,
                             *b.kv_rows.resolve(n_local))
            rows += [(b.rank, q0, q0 + ql, k0, k0 + kl) for _, q0, ql in qs for _, k0, kl in ks]
    return tuple(np.array(col, dtype=np.int64) for col in zip(*rows))


def _work(regions: tuple[np.ndarray, ...], lengths: np.ndarray, world_size: int) -> np.ndarray:
    """Visible causal pairs per rank for documents of ``lengths`` in that order."""
    rank, qa0, qb0, ka0, kb0 = (r[:, None] for r in regions)
    ends = np.cumsum(lengths)[None, :]
    starts = ends - lengths[None, :]
    qa, qb = np.maximum(qa0, starts), np.minimum(qb0, ends)
    ka, kb = np.maximum(ka0, starts), np.minimum(kb0, ends)
    u, w = np.maximum(qa, ka), np.minimum(qb, kb)  # rows that see part of the keys
    part = np.where(w > u, (w - u) * (u + w + 1 - 2 * ka) // 2, 0)
    whole = np.maximum(qb - np.maximum(qa, kb), 0) * (kb - ka)  # rows that see every key
    pairs = np.where((qa < qb) & (ka < kb), part + whole, 0).sum(axis=1)
    # float64 sums of integers below 2**53 are exact
    return np.bincount(rank[:, 0], weights=pairs, minlength=world_size).astype(np.int64)


def document_work(lengths, seq_len: int, world_size: int, kind: str = "distflash") -> list[int]:
    """The visible causal (query, key) pairs each rank computes under schedule ``kind``, for
    documents of ``lengths`` (in sequence order, summing to ``seq_len``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.sum() != seq_len:
        raise ValueError(f"document lengths sum to {int(lengths.sum())}, not {seq_len}")
    return [int(x) for x in _work(_regions(seq_len, world_size, kind), lengths, world_size)]


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
    Arguments as :func:`document_work`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    identity = tuple(range(len(lengths)))
    if world_size == 1 or len(lengths) < 2:
        return identity
    regions = _regions(seq_len, world_size, kind)
    spent = 0

    def cost(order: np.ndarray) -> int:
        nonlocal spent
        spent += 1
        return int(_work(regions, lengths[order], world_size).max())

    enough = GOOD_ENOUGH * int(_work(regions, lengths, world_size).sum()) / world_size

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
                        return tuple(int(x) for x in best)
                else:
                    best[i], best[j] = best[j], best[i]
    if best_cost >= scored[0][0]:
        return identity
    return tuple(int(x) for x in best)
