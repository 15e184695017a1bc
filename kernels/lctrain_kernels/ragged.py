"""A document-masked block as ragged batches: one batch entry per dense piece, read in place.

A ragged (THD) attention kernel runs a batch whose entries start anywhere in the q/k/v/out
tensors (one element offset per entry) and have lengths of their own (a padding mask over a
declared maximum). Every piece of a block (:mod:`lctrain_kernels.pieces`: FULL rectangles and
top-left causal triangles, one or two per document) is one such entry, read and written where
it lies: no gather, no scatter, no copy. Pieces of one kind share a call, so a block takes at
most two calls — its causal pieces and its FULL ones — however many documents it holds::

    block rows  |d0 d0 d0|d1 d1|d2 d2 d2 d2|     (documents of a diagonal block)
    causal call   entry 0: rows 0..2 x keys 0..2, entry 1: rows 3..4 x keys 3..4, ...

The two calls read disjoint keys (a document's FULL keys come before its first query row,
its causal keys from that row on), and their query rows are disjoint too except in a block
whose first document has keys before the block's first query AND from it on (an offset
diagonal): those rows get a FULL and a causal piece. :attr:`RaggedPlan.shared_rows` says so,
and the runner then merges the second call's rows through the lse and sums its dq.

What a kernel is compiled for — the batch size and the longest entry — is rounded up to a
power of two (:func:`bucket`), so the few plans built serve every mix of document lengths of
a run; entries past the real ones have length 0. The lengths and offsets themselves are data.
A call whose entries are equal and follow each other (:attr:`RaggedCall.uniform`: documents
of one length) is a plain batch, which an engine may run on its dense kernel instead.

:func:`ragged_forward` and :func:`ragged_grads` run a plan through an engine that executes one
:class:`RaggedCall`; :class:`RaggedBackend` is a backend on any engine (the cuDNN engine in
``backends.cudnn_ragged``; :class:`ReferenceEngine`, plain torch, runs the same contract on
any device for the tests). Layouts: q, out ``(B, Sq, Hq, D)``; k, v ``(B, Sk, Hkv, D)``; rows
are counted over the flattened batch (row ``b * Sq + i``); the lse an engine writes is
TOKEN-major ``(B * Sq, Hq)`` float32, as the ragged kernels keep their statistics.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from lctrain_kernels.backends.base import UnitValueLseGrad
from lctrain_kernels.combine import merge, sum_into
from lctrain_kernels.masks import MaskSpec, Relation
from lctrain_kernels.pieces import pieces
from lctrain_kernels.reference import reference_backward, reference_forward


def bucket(n: int) -> int:
    """The power of two ``>= n`` (at least 1): what a kernel is built for."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class RaggedCall:
    """One ragged attention call: entry ``e`` is query rows ``[q_rows[e], q_rows[e] +
    q_lens[e])`` against key rows ``[k_rows[e], k_rows[e] + k_lens[e])``, all visible
    (``causal=False``) or the lower triangle from the top-left corner (``causal=True``).
    Rows are flattened over the batch."""

    causal: bool
    q_rows: tuple[int, ...]
    k_rows: tuple[int, ...]
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]

    @property
    def entries(self) -> int:
        """The real entries (the kernel's batch is :func:`bucket` of this)."""
        return len(self.q_rows)

    @property
    def max_q(self) -> int:
        """The longest entry's query rows, bucketed."""
        return bucket(max(self.q_lens))

    @property
    def max_k(self) -> int:
        """The longest entry's key rows, bucketed."""
        return bucket(max(self.k_lens))

    @property
    def uniform(self) -> bool:
        """All entries have the same shape and follow each other without gaps: the call is
        a plain batch of ``entries`` equal blocks from its first rows on."""
        nq, nk = self.q_lens[0], self.k_lens[0]
        return (all(n == nq for n in self.q_lens) and all(n == nk for n in self.k_lens)
                and all(r == self.q_rows[0] + e * nq for e, r in enumerate(self.q_rows))
                and all(r == self.k_rows[0] + e * nk for e, r in enumerate(self.k_rows)))

    def padded(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(q_rows, k_rows, q_lens, k_lens) of the kernel's batch, each ``bucket(entries)``
        long (the extra entries are empty and start after the last real one), row lists
        with one more value: the end."""
        n, total = self.entries, bucket(self.entries)
        q_end = max(r + n_ for r, n_ in zip(self.q_rows, self.q_lens))
        k_end = max(r + n_ for r, n_ in zip(self.k_rows, self.k_lens))
        pad = total - n
        return ([*self.q_rows, *[q_end] * pad, q_end], [*self.k_rows, *[k_end] * pad, k_end],
                [*self.q_lens, *[0] * pad], [*self.k_lens, *[0] * pad])


@dataclass(frozen=True)
class RaggedPlan:
    """A block as one or two ragged calls (module docstring).

    Attributes:
        calls: the causal call first, then the FULL one; those that have entries.
        shared_rows: some query rows are in both calls (their results are merged).
        covers_q: every query row of the block is in some entry (no row to zero first).
        covers_k: every key row is in some entry (no gradient row to zero first).
    """

    calls: tuple[RaggedCall, ...]
    shared_rows: bool
    covers_q: bool
    covers_k: bool


def _covered(spans: list[tuple[int, int]]) -> int:
    """How many rows a set of [start, end) spans covers."""
    total, reach = 0, 0
    for a, b in sorted(spans):
        a = max(a, reach)
        if b > a:
            total += b - a
            reach = b
    return total


@functools.lru_cache(maxsize=4096)
def plan_ragged(spec: MaskSpec, sq: int, sk: int, batch: int = 1) -> RaggedPlan:
    """The ragged calls of a block of ``batch`` rows of ``sq`` queries by ``sk`` keys.

    Args:
        spec: the block's mask in global positions (the same for every batch row).
        sq: query rows per batch row.
        sk: key rows per batch row.
        batch: batch rows.

    Returns:
        The block's :class:`RaggedPlan`; no calls when nothing is visible.
    """
    parts = pieces(spec, sq, sk)
    calls = []
    for causal in (True, False):
        entries = [(b * sq + p.q0, b * sk + p.k0, p.sq, p.sk)
                   for b in range(batch) for p in parts if p.causal is causal]
        if entries:
            calls.append(RaggedCall(causal, *(tuple(x) for x in zip(*entries))))
    rows_q = sum(n for c in calls for n in c.q_lens)
    union_q = _covered([(r, r + n) for c in calls for r, n in zip(c.q_rows, c.q_lens)])
    union_k = _covered([(r, r + n) for c in calls for r, n in zip(c.k_rows, c.k_lens)])
    return RaggedPlan(tuple(calls), shared_rows=union_q < rows_q,
                      covers_q=union_q == batch * sq, covers_k=union_k == batch * sk)


class Engine(Protocol):
    """Runs one :class:`RaggedCall` in place (module docstring for layouts)."""

    def forward(self, call: RaggedCall, q, k, v, out, lse_t, scale: float) -> None:
        """Write the entries' rows of ``out`` and of the token-major ``lse_t``."""

    def backward(self, call: RaggedCall, do, q, k, v, out, lse_t, dq, dk, dv,
                 scale: float) -> None:
        """Write the entries' rows of ``dq``, ``dk`` and ``dv`` (dk, dv summed over each GQA
        group) from the final ``out`` and token-major ``lse_t`` of the query rows."""


def _lse_tokens(lse: torch.Tensor) -> torch.Tensor:
    """(B, H, S) lse -> token-major (B * S, H) float32 (float64 stays float64)."""
    b, h, s = lse.shape
    dtype = torch.float64 if lse.dtype == torch.float64 else torch.float32
    return lse.to(dtype).transpose(1, 2).reshape(b * s, h).contiguous()


def _new_out(q: torch.Tensor, zero: bool):
    b, s, h, _ = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros(q.shape) if zero else q.new_empty(q.shape)  # contiguous
    lse_t = (q.new_full((b * s, h), float("-inf"), dtype=dtype) if zero
             else q.new_empty((b * s, h), dtype=dtype))
    return out, lse_t


def _as_bhs(lse_t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    b, s, h, _ = q.shape
    return lse_t.view(b, s, h).transpose(1, 2).contiguous()  # (B, Hq, Sq)


def ragged_forward(engine: Engine, plan: RaggedPlan, q, k, v, scale: float):
    """(out, lse) of a block: out ``(B, Sq, Hq, D)`` in q's dtype, lse ``(B, Hq, Sq)``
    float32 (float64 for float64 inputs); rows no entry reaches get 0 and -inf."""
    out, lse_t = _new_out(q, zero=not plan.covers_q or plan.shared_rows)
    own = plan.calls[:1] if plan.shared_rows else plan.calls
    for call in own:
        engine.forward(call, q, k, v, out, lse_t, scale)
    lse = _as_bhs(lse_t, q)
    for call in plan.calls[len(own):]:  # rows shared with the first call: merged
        out_b, lse_b = _new_out(q, zero=True)
        engine.forward(call, q, k, v, out_b, lse_b, scale)
        merged, lse = merge(out, lse, out_b, _as_bhs(lse_b, q))
        out = merged.to(q.dtype)
    return out, lse


def ragged_grads(engine: Engine, plan: RaggedPlan, do, q, k, v, out, lse, scale: float):
    """(dq, dk, dv) of a block from the final ``out`` and ``lse`` of its query rows, in the
    inputs' dtype (dq in float32 where two calls share rows); rows no entry reaches get 0."""
    lse_t = _lse_tokens(lse)
    do, out = do.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    zero_q, zero_k = not plan.covers_q or plan.shared_rows, not plan.covers_k
    dq = q.new_zeros(q.shape) if zero_q else q.new_empty(q.shape)  # all contiguous
    dk = k.new_zeros(k.shape) if zero_k else k.new_empty(k.shape)
    dv = v.new_zeros(v.shape) if zero_k else v.new_empty(v.shape)
    shared = []
    for i, call in enumerate(plan.calls):
        dq_i = dq
        if i and plan.shared_rows:
            dq_i = q.new_zeros(q.shape)
            shared.append(dq_i)
        engine.backward(call, do, q, k, v, out, lse_t, dq_i, dk, dv, scale)
    if shared:
        wide = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, torch.float32),
                           device=q.device)
        sum_into(wide, [dq, *shared])
        dq = wide
    return dq, dk, dv


class ReferenceEngine:
    """The ragged contract on the reference kernels (:mod:`lctrain_kernels.reference`), one
    entry at a time, in float32 (float64 for float64 inputs); any device. It runs
    :func:`ragged_forward` / :func:`ragged_grads` where no ragged kernel exists, so the block
    logic is tested on a CPU against the float64 oracle of the whole block."""

    @staticmethod
    def _entries(call: RaggedCall):
        yield from zip(call.q_rows, call.k_rows, call.q_lens, call.k_lens)

    @staticmethod
    def _rows(x: torch.Tensor, r: int, n: int) -> torch.Tensor:
        return x.reshape(-1, *x.shape[2:])[r:r + n]  # (n, H, D) view of flattened rows

    def forward(self, call, q, k, v, out, lse_t, scale):
        spec = MaskSpec(call.causal)  # causal from the top-left corner
        for rq, rk, nq, nk in self._entries(call):
            o, lse = reference_forward(self._rows(q, rq, nq)[None], self._rows(k, rk, nk)[None],
                                       self._rows(v, rk, nk)[None], spec, scale)
            self._rows(out, rq, nq).copy_(o[0])
            lse_t[rq:rq + nq] = lse[0].transpose(0, 1)

    def backward(self, call, do, q, k, v, out, lse_t, dq, dk, dv, scale):
        spec = MaskSpec(call.causal)
        for rq, rk, nq, nk in self._entries(call):
            rows = [self._rows(x, rq, nq)[None] for x in (do, q)]
            keys = [self._rows(x, rk, nk)[None] for x in (k, v)]
            grads = reference_backward(*rows, *keys, self._rows(out, rq, nq)[None],
                                       lse_t[rq:rq + nq].transpose(0, 1)[None], spec, scale)
            for dst, r, n, grad in ((dq, rq, nq, grads[0]), (dk, rk, nk, grads[1]),
                                    (dv, rk, nk, grads[2])):
                self._rows(dst, r, n).copy_(grad[0])


class RaggedBackend(UnitValueLseGrad):
    """A Backend that runs every block as ragged calls on ``engine``; the engines compute
    ``delta`` themselves, so a gradient of the lse takes one more backward."""

    name = "ragged"

    def __init__(self, engine: Engine):
        self.engine = engine

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        return None

    def forward(self, q, k, v, spec, relation, scale):
        plan = plan_ragged(spec, q.shape[1], k.shape[1], q.shape[0])
        return ragged_forward(self.engine, plan, q, k, v, scale)

    def grads(self, do, q, k, v, out, lse, spec, relation, scale):
        plan = plan_ragged(spec, q.shape[1], k.shape[1], q.shape[0])
        return ragged_grads(self.engine, plan, do, q, k, v, out, lse, scale)
