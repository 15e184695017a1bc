"""A masked block as ragged batches: one batch entry per dense piece, read and written in place.

Inside one document, causal attention between a block's rows and keys is at most two dense
shapes: the keys before the document's first query row (a FULL rectangle) and the top-left
triangle from that row on (CAUSAL). :func:`pieces` cuts a block into these, disjoint, their union
exactly the block's mask. A ragged (THD) kernel runs a batch whose entries start anywhere; pieces
of one kind share a call, so a block takes at most two calls::

    block rows  |d0 d0 d0|d1 d1|d2 d2 d2 d2|     (documents of a diagonal block)
    causal call   entry 0: rows 0..2 x keys 0..2, entry 1: rows 3..4 x keys 3..4, ...

The two calls read disjoint keys; rows they share (an offset diagonal) are merged through the lse
(:attr:`RaggedPlan.shared_rows`). Batch size and longest entry are rounded up to a power of two
(:func:`bucket`), so a few compiled plans serve every mix. Engines (``backends.cudnn_ragged``,
``backends.flash_attn_cute``) run one :class:`RaggedCall`; rows count over the flattened batch
(row ``b * Sq + i``) and an engine's lse is TOKEN-major ``(B * Sq, Hq)`` float32."""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from lctrain_kernels.backends import UnitValueLseGrad
from lctrain_kernels.combine import lse_dtype, merge, sum_into
from lctrain_kernels.masks import MaskSpec, Relation


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
    """(qa, qb, ka, kb) in global positions for each document both sides of a block reach."""
    q0, q1, k0, k1 = spec.q_start, spec.q_start + sq, spec.k_start, spec.k_start + sk
    bounds = spec.doc_bounds if spec.doc_bounds is not None else (0, max(q1, k1))
    if max(q1, k1) > bounds[-1]:
        raise ValueError(f"block reaches position {max(q1, k1) - 1} but cu_seqlens ends at "
                         f"{bounds[-1]}; the documents must cover the whole sequence.")
    doc = lambda pos: bisect.bisect_right(bounds, pos) - 1  # noqa: E731 - document of pos
    for d in range(max(doc(q0), doc(k0)), min(doc(q1 - 1), doc(k1 - 1)) + 1):
        yield (max(q0, bounds[d]), min(q1, bounds[d + 1]),
               max(k0, bounds[d]), min(k1, bounds[d + 1]))


def pieces(spec: MaskSpec, sq: int, sk: int) -> tuple[Piece, ...]:
    """The exact dense decomposition of a block (module docstring), in block-local rows and
    document order; only the document of the first query may have a FULL and a CAUSAL piece."""
    parts = []
    for qa, qb, ka, kb in (_doc_regions(spec, sq, sk) if sq > 0 and sk > 0 else ()):
        dq, dk = spec.q_start, spec.k_start
        if not spec.causal:
            parts.append(Piece(qa - dq, ka - dk, qb - qa, kb - ka, False))
            continue
        r0 = max(qa, ka)  # query rows before the document's first key see nothing
        if r0 >= qb:
            continue
        kb = min(kb, qb)  # keys after the last query are never seen
        if ka < r0:  # keys before every query: all visible
            parts.append(Piece(r0 - dq, ka - dk, qb - r0, min(r0, kb) - ka, False))
        if kb > r0:  # keys from the first query on: the triangle from the top-left corner
            parts.append(Piece(r0 - dq, r0 - dk, qb - r0, kb - r0, True))
    return tuple(parts)


def bucket(n: int) -> int:
    """The power of two ``>= n`` (at least 1): what a kernel is built for."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class RaggedCall:
    """One ragged call: entry ``e`` is rows ``[q_rows[e], +q_lens[e])`` against keys
    ``[k_rows[e], +k_lens[e])``, all visible or (``causal``) the top-left triangle."""

    causal: bool
    q_rows: tuple[int, ...]
    k_rows: tuple[int, ...]
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]

    @property
    def entries(self) -> int:
        return len(self.q_rows)

    @property
    def max_q(self) -> int:
        return bucket(max(self.q_lens))

    @property
    def max_k(self) -> int:
        return bucket(max(self.k_lens))

    @property
    def uniform(self) -> bool:
        """Equal entries that follow each other: a plain batch from the first rows on."""
        nq, nk = self.q_lens[0], self.k_lens[0]
        return (all(n == nq for n in self.q_lens) and all(n == nk for n in self.k_lens)
                and all(r == self.q_rows[0] + e * nq for e, r in enumerate(self.q_rows))
                and all(r == self.k_rows[0] + e * nk for e, r in enumerate(self.k_rows)))

    def padded(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(q_rows, k_rows, q_lens, k_lens) of the kernel's batch of ``bucket(entries)``
        (extra entries empty, after the last); row lists end with the end row."""
        n, total = self.entries, bucket(self.entries)
        q_end = max(r + n_ for r, n_ in zip(self.q_rows, self.q_lens))
        k_end = max(r + n_ for r, n_ in zip(self.k_rows, self.k_lens))
        pad = total - n
        return ([*self.q_rows, *[q_end] * pad, q_end], [*self.k_rows, *[k_end] * pad, k_end],
                [*self.q_lens, *[0] * pad], [*self.k_lens, *[0] * pad])


@dataclass(frozen=True)
class RaggedPlan:
    """A block as its causal call and its FULL call (those with entries); ``shared_rows``:
    some rows are in both (merged); ``covers_q`` / ``covers_k``: every query / key row is in
    some entry (nothing to zero first)."""

    calls: tuple[RaggedCall, ...]
    shared_rows: bool
    covers_q: bool
    covers_k: bool


def _covered(spans: list[tuple[int, int]]) -> int:
    total, reach = 0, 0
    for a, b in sorted(spans):
        a = max(a, reach)
        if b > a:
            total += b - a
            reach = b
    return total


@functools.lru_cache(maxsize=4096)
def plan_ragged(spec: MaskSpec, sq: int, sk: int, batch: int = 1) -> RaggedPlan:
    """The :class:`RaggedPlan` of a block of ``batch`` rows of ``sq`` queries by ``sk`` keys
    under ``spec`` (the same for every batch row); no calls when nothing is visible."""
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
    """Runs one :class:`RaggedCall` in place (module docstring)."""

    def forward(self, call: RaggedCall, q, k, v, out, lse_t, scale: float) -> None:
        """Write the entries' rows of ``out`` and of the token-major ``lse_t``."""

    def backward(self, call: RaggedCall, do, q, k, v, out, lse_t, dq, dk, dv,
                 scale: float) -> None:
        """Write the entries' rows of dq, dk, dv (summed per GQA group)."""


def _new_out(q: torch.Tensor, zero: bool):
    b, s, h, _ = q.shape
    dtype = lse_dtype(q.dtype)
    out = q.new_zeros(q.shape) if zero else q.new_empty(q.shape)  # contiguous
    lse_t = (q.new_full((b * s, h), float("-inf"), dtype=dtype) if zero
             else q.new_empty((b * s, h), dtype=dtype))
    return out, lse_t


def _as_bhs(lse_t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    b, s, h, _ = q.shape
    return lse_t.view(b, s, h).transpose(1, 2).contiguous()  # (B, Hq, Sq)


def ragged_forward(engine: Engine, plan: RaggedPlan, q, k, v, scale: float):
    """(out (B, Sq, Hq, D), lse (B, Hq, Sq)) of a block; rows no entry reaches: 0 and -inf."""
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
    """(dq, dk, dv) of a block from the final out and lse of its rows (dq in float32 where
    two calls share rows); rows no entry reaches get 0."""
    lse_t = lse.to(lse_dtype(lse.dtype)).transpose(1, 2).flatten(0, 1).contiguous()  # (B·Sq, Hq)
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


class RaggedBackend(UnitValueLseGrad):
    """A Backend running every block as ragged calls on ``engine`` (which computes delta)."""

    name = "ragged"

    def __init__(self, engine: Engine):
        self.engine = engine

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        return None

    def setup_reason(self, device: torch.device) -> str | None:
        """None if this process can run the backend on ``device`` at all, else why not: the
        GPU engines' kernels need a Hopper or newer GPU and their backward is not deterministic."""
        if torch.are_deterministic_algorithms_enabled():
            return (f"the {self.name} backend's backward is not guaranteed to be deterministic, "
                    f"and torch.use_deterministic_algorithms is on; use triton, whose kernels are.")
        if device.type != "cuda":
            return f"the {self.name} backend runs on CUDA only, and the tensors are on {device}."
        if torch.cuda.get_device_capability(device) < (9, 0):
            return (f"the {self.name} backend needs a Hopper or newer GPU (compute capability "
                    f">= 9.0).")
        return None

    def forward(self, q, k, v, spec, relation, scale):
        plan = plan_ragged(spec, q.shape[1], k.shape[1], q.shape[0])
        return ragged_forward(self.engine, plan, q, k, v, scale)

    def grads(self, do, q, k, v, out, lse, spec, relation, scale):
        plan = plan_ragged(spec, q.shape[1], k.shape[1], q.shape[0])
        return ragged_grads(self.engine, plan, do, q, k, v, out, lse, scale)
