"""Execute a schedule's plan on one rank: post messages, compute blocks, fold results in.

The loop over a plan's steps (``overlap=True``)::

    pending = post(inputs of step 0)
    for k in steps:
        wait(pending)                      # inputs of step k, results of step k-2 have arrived
        absorb results of step k-2         # merge partial (out, lse) / add dq, dk, dv
        pending = post(inputs of step k+1 + results of step k-1)   # BEFORE computing step k
        compute step k                     # the transfers above run meanwhile
    wait, absorb; post(results of the last step); wait, absorb

With ``overlap=False`` (the ablation) each step posts its own inputs and waits at once. Every block
is cut at the layout's chunk boundaries into local calls with global positions; EMPTY pieces are
skipped, adjacent fully visible ones fused into one FULL call. Results are combined once per row
(``combine.OutAcc``, ``GradAcc``). With ``head_groups`` G the heads run in G groups one after the
other, so every buffer holds Hq/G heads."""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from lctrain_kernels.backends import block_backward, block_forward
from lctrain_kernels.combine import GradAcc, OutAcc, lse_dtype
from lctrain_kernels.distributed.balance import balanced_cuts, balanced_split
from lctrain_kernels.distributed.comm import Exchanger, Pending
from lctrain_kernels.distributed.layout import local_spans
from lctrain_kernels.distributed.schedule import HALF, Block, Message, Plan, Rows, make_schedule
from lctrain_kernels.masks import MaskSpec, Relation, classify


_HEAD_START_CYCLES = 30_000  # GPU clock cycles (~15 µs) the compute stream yields to transfers


def head_slices(groups: int, hq: int, hkv: int) -> list[tuple[slice, slice]]:
    """(query heads, key/value heads) of each of ``groups`` head groups: group g takes query
    heads [g·hq/G, (g+1)·hq/G) and the key/value heads they read (``groups`` divides ``hkv``,
    as :func:`lctrain_kernels.distributed.op.op_options` checks)."""
    gq, gk = hq // groups, hkv // groups
    return [(slice(g * gq, (g + 1) * gq), slice(g * gk, (g + 1) * gk)) for g in range(groups)]


def forward_in_groups(run, q, k, v, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``run(q, k, v) -> (out, lse)`` over head groups of contiguous (B, n, h, D) copies."""
    if groups == 1:
        return run(q, k, v)
    out, lse = None, None
    for qs, ks in head_slices(groups, q.shape[2], k.shape[2]):
        o, l = run(q[:, :, qs].contiguous(), k[:, :, ks].contiguous(), v[:, :, ks].contiguous())
        if out is None:
            out = q.new_empty(q.shape)  # (B, n, Hq, D)
            lse = l.new_empty((q.shape[0], q.shape[2], q.shape[1]))  # (B, Hq, n)
        out[:, :, qs] = o
        lse[:, qs] = l
    return out, lse


def backward_in_groups(run, do, q, k, v, out, lse, dlse, groups: int):
    """``run(do, q, k, v, out, lse, dlse) -> (dq, dk, dv)`` over head groups, one by one."""
    if groups == 1:
        return run(do, q, k, v, out, lse, dlse)
    grads = None
    for qs, ks in head_slices(groups, q.shape[2], k.shape[2]):
        heads = lambda x, s=qs: x[:, :, s].contiguous()  # noqa: E731 - (B, n, h, D) part
        rows = lambda x, s=qs: None if x is None else x[:, s].contiguous()  # noqa: E731
        got = run(heads(do), heads(q), k[:, :, ks].contiguous(), v[:, :, ks].contiguous(),
                  heads(out), rows(lse), rows(dlse))
        if grads is None:
            grads = tuple(g.new_empty(x.shape) for g, x in zip(got, (q, k, v)))
        for full, part, s in zip(grads, got, (qs, ks, ks)):
            full[:, :, s] = part
    return grads


@dataclass(frozen=True)
class Call:
    """Rows ``[qa, qb)`` of a block's queries against its keys ``[ka, kb)``, under ``spec``."""

    qa: int
    qb: int
    ka: int
    kb: int
    spec: MaskSpec


@dataclass(frozen=True)
class Geometry:
    """What every rank knows about one call: sizes, layout, mask."""

    seq_len: int
    world_size: int
    layout: str
    causal: bool
    bounds: tuple[int, ...] | None

    @property
    def n_local(self) -> int:
        return self.seq_len // self.world_size


@functools.lru_cache(maxsize=4096)
def block_calls(block: Block, geo: Geometry) -> tuple[Call, ...]:
    """The local calls that compute ``block`` (empty tuple when nothing in it is visible)."""
    (a, b), (c, d) = block.q_rows.resolve(geo.n_local), block.kv_rows.resolve(geo.n_local)
    if a == b or c == d:  # a split block of no rows (a short sequence split near one end)
        return ()
    span = functools.partial(local_spans, geo.seq_len, geo.world_size, layout=geo.layout)
    qs = [(lo - a, g, ln) for lo, g, ln in span(rank=block.q_owner, start=a, stop=b)]
    ks = [(lo - c, g, ln) for lo, g, ln in span(rank=block.kv_owner, start=c, stop=d)]
    specs = [[MaskSpec(geo.causal, gq, gk, geo.bounds) for _, gk, _ in ks] for _, gq, _ in qs]
    rel = [[classify(specs[i][j], qs[i][2], ks[j][2]) for j in range(len(ks))] for i in range(len(qs))]
    full = MaskSpec(False)
    if all(r is Relation.FULL for row in rel for r in row):
        return (Call(0, b - a, 0, d - c, full if len(qs) * len(ks) > 1 else specs[0][0]),)
    calls, done = [], set()
    for j, (k0, _, kl) in enumerate(ks):  # every query piece sees all of key piece j
        if len(qs) > 1 and all(rel[i][j] is Relation.FULL for i in range(len(qs))):
            calls.append(Call(0, b - a, k0, k0 + kl, full))
            done |= {(i, j) for i in range(len(qs))}
    for i, (q0, _, ql) in enumerate(qs):  # query piece i sees all of every key piece
        if len(ks) > 1 and all(rel[i][j] is Relation.FULL and (i, j) not in done for j in range(len(ks))):
            calls.append(Call(q0, q0 + ql, 0, d - c, full))
            done |= {(i, j) for j in range(len(ks))}
    for i, (q0, _, ql) in enumerate(qs):
        for j, (k0, _, kl) in enumerate(ks):
            if (i, j) not in done and rel[i][j] is not Relation.EMPTY:
                calls.append(Call(q0, q0 + ql, k0, k0 + kl, specs[i][j]))
    return tuple(calls)


@functools.lru_cache(maxsize=16)
def _split_and_cuts(kind: str, geo: Geometry):
    """``balanced_split`` and ``balanced_cuts`` for the documents (once for both directions)."""
    lengths = np.diff(geo.bounds)
    split = balanced_split(lengths, geo.seq_len, geo.world_size, kind)
    return split, balanced_cuts(lengths, geo.seq_len, geo.world_size, kind, split)


@functools.lru_cache(maxsize=64)
def pruned_plan(kind: str, direction: str, geo: Geometry) -> Plan:
    """The schedule's plan, split where the documents' work comes out even (``balanced_split``)
    and each diagonal cut where the ranks post their transfers together (``balanced_cuts``),
    without the blocks that the mask leaves EMPTY, and each block that travels cut to the rows
    that see something (``visible_rows``): the same on every rank."""
    documents = geo.causal and geo.bounds is not None
    split, cuts = _split_and_cuts(kind, geo) if documents else (HALF, None)
    plan = make_schedule(geo.world_size, kind).plan(direction, geo.causal, split, cuts)
    plan = plan.pruned(lambda blk: not block_calls(blk, geo))
    trim = documents and geo.layout == "contiguous"
    return plan.trimmed(lambda blk: visible_rows(blk, geo)) if trim else plan


def visible_rows(block: Block, geo: Geometry) -> tuple[Rows, Rows]:
    """The hulls of ``block``'s query rows that see a key of it and of its keys that a query of
    it sees, under causal documents in the contiguous layout (rank r holds [r·n, (r+1)·n))."""
    n, bounds = geo.n_local, geo.bounds
    (a, b), (c, d) = block.q_rows.resolve(n), block.kv_rows.resolve(n)
    q0, k0 = block.q_owner * n, block.kv_owner * n
    # query g sees key k iff k <= g and no document starts in (k, g]
    q_lo, q_hi = max(q0 + a, k0 + c), min(q0 + b, bounds[bisect.bisect_left(bounds, k0 + d)])
    k_lo, k_hi = max(k0 + c, bounds[bisect.bisect_right(bounds, q0 + a) - 1]), min(k0 + d, q0 + b)
    if q_lo >= q_hi or k_lo >= k_hi:
        return block.q_rows, block.kv_rows
    return (Rows(Fraction(q_lo - q0, n), Fraction(q_hi - q0, n)),
            Rows(Fraction(k_lo - k0, n), Fraction(k_hi - k0, n)))


class Engine:
    """Runs a plan's steps on one rank (``compute=False``: the messages alone), per direction."""

    def __init__(self, plan: Plan, geo: Geometry, exchanger: Exchanger, overlap: bool, k, v,
                 scale: float, backend: str, compute: bool):
        self.plan, self.geo, self.exch, self.overlap, self.device = plan, geo, exchanger, overlap, k.device
        self.scale, self.backend, self.compute_enabled = scale, backend, compute
        self.rank, self.n = exchanger.rank, geo.n_local
        # kv owner -> (k, v, the first of its rows they hold); own k, v (B, n, Hkv, D) each
        self.kv_have: dict[int, tuple] = {self.rank: (k, v, 0)}
        self.q_in: dict[tuple, list[torch.Tensor]] = {}  # (owner, rows) -> received q tensors
        self.results: dict[Message, list[torch.Tensor]] = {}  # outputs waiting to be sent
        self.last_use: dict[int, int] = {}  # kv owner -> the last step that reads its k, v
        for k, step in enumerate(self.plan.steps):
            for owner in [b.kv_owner for b in step.blocks if b.rank == self.rank] + [
                    m.owner for m in step.inputs if m.kind == "kv" and m.src == self.rank]:
                self.last_use[owner] = k

    def run(self) -> None:
        steps = self.plan.steps
        last = len(steps)

        def batch(k_in: int, k_out: int) -> list[Message]:
            ins = list(steps[k_in].inputs) if 0 <= k_in < last else []
            return ins + (list(steps[k_out].outputs) if 0 <= k_out < last else [])

        pending = self._post(batch(0, -1)) if self.overlap else (Pending(), [])
        for k in range(last):
            self._receive(pending)
            if self.overlap:
                pending = self._post(batch(k + 1, k - 1))
                if pending[0].works and self.device.type == "cuda":
                    # hold the compute stream briefly: a persistent attention kernel that starts
                    # first holds every SM to its end, and the transfers would wait for it
                    torch.cuda._sleep(_HEAD_START_CYCLES)
            else:
                self._receive(self._post(batch(k, k - 1)))
            if self.compute_enabled:
                self.compute([b for b in steps[k].blocks if b.rank == self.rank])
            else:
                for m in (m for m in steps[k].outputs if m.src == self.rank):
                    self.results[m] = [torch.empty(shape, dtype=dt, device=self.device)
                                       for shape, dt in self.specs(m)]
            self.q_in.clear()
            for owner in [o for o, at in self.last_use.items() if at <= k and o != self.rank]:
                self.kv_have.pop(owner, None)
        self._receive(pending)
        self._receive(self._post(batch(last, last - 1)))

    def _post(self, batch: list[Message]) -> tuple[Pending, list[Message]]:
        sends = [(self.send_tensors(m), m.dst, tag) for tag, m in enumerate(batch) if m.src == self.rank]
        recvs = [(self.specs(m), m.src, tag) for tag, m in enumerate(batch) if m.dst == self.rank]
        return self.exch.post(sends, recvs, self.device), [m for m in batch if m.dst == self.rank]

    def _receive(self, posted: tuple[Pending, list[Message]]) -> None:
        pending, messages = posted
        for m, tensors in zip(messages, pending.wait()):
            if m.kind == "kv":
                self.kv_have[m.owner] = (*tensors, m.rows.resolve(self.n)[0])
            elif m.kind == "q":
                self.q_in[(m.owner, m.rows)] = tensors
            elif self.compute_enabled:
                self.absorb(m, tensors)

    def send_tensors(self, m: Message) -> list[torch.Tensor]:
        """The tensors of an outgoing message (own or forwarded k/v, own q rows, results)."""
        if m.kind == "kv":
            return list(self.kv(m.owner, m.rows))
        if m.kind == "q":
            return self.local_rows(m.rows)
        return list(self.results.pop(m))

    def kv(self, owner: int, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``owner`` (own or received), restricted to ``rows``."""
        c, d = rows.resolve(self.n)
        k, v, s = self.kv_have[owner]
        return k[:, c - s:d - s], v[:, c - s:d - s]  # (B, d - c, Hkv, D) each

    def q_rows(self, block: Block) -> list[torch.Tensor]:
        """The query-side tensors of a block: own rows, or the ones received for it."""
        if block.q_owner == self.rank:
            return self.local_rows(block.q_rows)
        return self.q_in[(block.q_owner, block.q_rows)]

    def specs(self, m: Message) -> list:
        """(shape, dtype) of each tensor of ``m``: those of this rank's own tensors of its kind
        (``self.like``) at its rows, as every rank's tensors have one shape."""
        a, b = m.rows.resolve(self.n)
        rows = [(1 if t.dim() == 4 else 2, t) for t in self.like[m.kind]]  # the row dimension
        return [((*t.shape[:d], b - a, *t.shape[d + 1:]), t.dtype) for d, t in rows]

    def local_rows(self, rows) -> list[torch.Tensor]:
        """This rank's query-side tensors (``self.like["q"]``) at ``rows``: (B, b - a, Hq, D)
        each, and each (B, Hq, b - a) lse contiguous."""
        a, b = rows.resolve(self.n)
        return [t[:, a:b] if t.dim() == 4 else t[:, :, a:b].contiguous() for t in self.like["q"]]

    # Hooks of a direction: like (tensors shaped as each message kind's), absorb(m, tensors),
    # compute(blocks).


class ForwardEngine(Engine):
    """Forward: k/v and q rows travel in, partial (out, lse) travel home and are merged."""

    def __init__(self, plan, geo, exchanger, overlap, q, k, v, scale: float, backend: str,
                 compute: bool = True):
        super().__init__(plan, geo, exchanger, overlap, k, v, scale, backend, compute)
        self.acc = OutAcc(self.n)
        lse = torch.empty((q.shape[0], q.shape[2], self.n), dtype=lse_dtype(q.dtype), device="meta")
        self.like = {"kv": (k, v), "q": (q,), "out": (q, lse)}  # q (B, n, Hq, D), lse (B, Hq, n)

    def absorb(self, m: Message, tensors: list[torch.Tensor]) -> None:
        a, b = m.rows.resolve(self.n)
        self.acc.add(a, b, *tensors)

    def compute(self, blocks: list[Block]) -> None:
        for blk in blocks:
            (qt,), (kt, vt) = self.q_rows(blk), self.kv(blk.kv_owner, blk.kv_rows)
            a, b = blk.q_rows.resolve(self.n)
            own = blk.q_owner == self.rank
            acc, base = (self.acc, a) if own else (OutAcc(b - a), 0)
            for c in block_calls(blk, self.geo):
                out, lse = block_forward(qt[:, c.qa:c.qb], kt[:, c.ka:c.kb], vt[:, c.ka:c.kb], c.spec,
                                         scale=self.scale, backend=self.backend)
                acc.add(base + c.qa, base + c.qb, out, lse)
            if not own:
                msg = Message("out", self.rank, blk.q_owner, blk.q_owner, blk.q_rows)
                self.results[msg] = list(acc.result(qt))


class BackwardEngine(Engine):
    """Backward: k/v and (q, dO, out, lse[, dlse]) rows travel in, dq and (dk, dv) travel home;
    every rank passes a ``dlse``, or none."""

    def __init__(self, plan, geo, exchanger, overlap, do, q, k, v, out, lse, scale: float,
                 backend: str, compute: bool = True, dlse: torch.Tensor | None = None):
        super().__init__(plan, geo, exchanger, overlap, k, v, scale, backend, compute)
        self.dq, self.dk, self.dv = GradAcc(self.n), GradAcc(self.n), GradAcc(self.n)
        q_side = (q, do, out, lse) + (() if dlse is None else (dlse,))  # (B, n, Hq, D) x3, (B, Hq, n)
        self.like = {"kv": (k, v), "dkv": (k, v), "q": q_side, "dq": (q,)}

    def absorb(self, m: Message, tensors: list[torch.Tensor]) -> None:
        a, b = m.rows.resolve(self.n)
        if m.kind == "dq":
            self.dq.add(a, b, tensors[0])
        else:
            self.dk.add(a, b, tensors[0])
            self.dv.add(a, b, tensors[1])

    def compute(self, blocks: list[Block]) -> None:
        for blk in blocks:
            (qt, dot, ot, *lt), (kt, vt) = self.q_rows(blk), self.kv(blk.kv_owner, blk.kv_rows)
            (a, b), (c0, c1) = blk.q_rows.resolve(self.n), blk.kv_rows.resolve(self.n)
            own_q, own_kv = blk.q_owner == self.rank, blk.kv_owner == self.rank
            dq, qbase = (self.dq, a) if own_q else (GradAcc(b - a), 0)
            dk, dv, kbase = (self.dk, self.dv, c0) if own_kv else (GradAcc(c1 - c0), GradAcc(c1 - c0), 0)
            for c in block_calls(blk, self.geo):
                whole = (c.qa, c.qb) == (0, b - a)
                lse, *dlse = (x if whole else x[:, :, c.qa:c.qb].contiguous() for x in lt)
                g = block_backward(dot[:, c.qa:c.qb], qt[:, c.qa:c.qb], kt[:, c.ka:c.kb], vt[:, c.ka:c.kb],
                                   ot[:, c.qa:c.qb], lse, c.spec, scale=self.scale, backend=self.backend,
                                   dlse=dlse[0] if dlse else None)
                dq.add(qbase + c.qa, qbase + c.qb, g[0])
                dk.add(kbase + c.ka, kbase + c.kb, g[1])
                dv.add(kbase + c.ka, kbase + c.kb, g[2])
            if not own_q:
                self.results[Message("dq", self.rank, blk.q_owner, blk.q_owner, blk.q_rows)] = [dq.result(qt)]
            if not own_kv:
                msg = Message("dkv", self.rank, blk.kv_owner, blk.kv_owner, blk.kv_rows)
                self.results[msg] = [dk.result(kt), dv.result(vt)]
