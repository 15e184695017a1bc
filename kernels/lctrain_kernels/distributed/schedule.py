"""Who computes which attention block when, and what travels where: DistFlashAttn's schedule.

P ranks; in the "contiguous" layout rank r holds chunk r of q, k, v. Causal attention of chunk r
needs the k, v of chunks 0..r: the lower triangle of P × P blocks, a diagonal block half a block
of work; P/2 per rank when balanced. The plain "ring" passes k, v to the neighbour each step: at
step t rank r computes (q_r, kv_{r−t}) if r ≥ t and idles otherwise, so rank P−1 does P−½ blocks
and rank 0 ½.

"distflash" lets the idle ranks help. Block (q_r, kv_c) has distance d = r − c. At step
t = 1..⌊(P−1)/2⌋ every rank r sends to peer (r+t) mod P:

* its k, v if r + t < P: the receiver computes its own block (q_{r+t}, kv_r), distance t;
* its q if r + t ≥ P: the receiver r+t−P owns the keys q_r needs at distance P−t, computes that
  block for r and sends the partial (out, lse) back, which r merges through the lse.

Each step is one shift-by-t permutation, every rank computes one full block per step, and
distances t and P−t are covered together: for odd P that is everything. For even P the blocks at
distance P/2 are split by query rows between the owner (rows before ``split``) and the keys' owner
(the rest). At the default half every rank does exactly P/2 blocks: balance 1.0 for every P. With
documents the visible pairs of those blocks lie unevenly, and ``balance.balanced_split`` moves the
split to where the ranks' work comes out even.

Overlap: the executor posts step t+1's inputs and step t−1's results before computing step t.
The first step's inputs and the last step's results have nothing to hide behind, so for P > 1
each diagonal block is cut at ``cut``: all q rows against the keys before it run first, rows
[cut, 1) against keys [cut, 1) last (at the default ½: ⅜ and ⅛ of a block). A transfer starts
once both ranks have posted it, and NCCL's kernel holds its SMs from the first one's post; with
documents the ranks' steps differ in length, and ``balance.balanced_cuts`` moves each rank's cut
so that they post their results together.

Backward runs the same steps: a "q" message carries (q, dO, out, lse[, dlse]); a block computed by
its query owner sends dk, dv to the keys' owner ("dkv"), a helped block sends dq home ("dq").
"zigzag" is the ring over the head-tail layout. With documents the executor drops the blocks the
mask leaves EMPTY (:meth:`Plan.pruned`) and cuts each block that travels, with its messages, to
the query rows and keys that see something (:meth:`Plan.trimmed`): a document crossing into
the next chunk needs only its own keys there. Non-causal distflash sends k, v straight from r−t
to r."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Callable

from lctrain_kernels.distributed.layout import local_spans
from lctrain_kernels.vocabulary import chunks_per_rank, schedule_layout, seq_chunks

DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True, order=True)
class Rows:
    """A run of local rows given as fractions of the local length: ``[start, stop)``."""

    start: Fraction
    stop: Fraction

    def resolve(self, n: int) -> tuple[int, int]:
        """Token indices ``(a, b)`` for a local length ``n`` (floor; identical on every rank)."""
        return (self.start.numerator * n // self.start.denominator,
                self.stop.numerator * n // self.stop.denominator)


ALL = Rows(Fraction(0), Fraction(1))
HALF = Fraction(1, 2)


@dataclass(frozen=True)
class Block:
    """One unit of compute: q rows of ``q_owner`` against k/v rows of ``kv_owner``, on ``rank``."""

    rank: int
    q_owner: int
    q_rows: Rows
    kv_owner: int
    kv_rows: Rows


@dataclass(frozen=True)
class Message:
    """A point-to-point transfer of ``kind`` of ``owner``'s ``rows``: "kv" (k, v), "q" (forward:
    q; backward: q, dO, out, lse[, dlse]), "out" (a partial out, lse), "dq" and "dkv" (gradients
    going home)."""

    kind: str
    src: int
    dst: int
    owner: int
    rows: Rows


@dataclass(frozen=True)
class Step:
    """``inputs`` arrive before ``blocks`` compute; ``outputs`` carry their results home."""

    blocks: tuple[Block, ...]
    inputs: tuple[Message, ...]
    outputs: tuple[Message, ...] = ()


@dataclass(frozen=True)
class Plan:
    """A schedule made concrete for one direction and mask type."""

    direction: str
    world_size: int
    layout: str
    causal: bool
    steps: tuple[Step, ...]

    def pruned(self, is_empty: Callable[[Block], bool]) -> "Plan":
        """The plan without the blocks ``is_empty`` rejects and the messages only they needed."""
        steps = [[b for b in s.blocks if not is_empty(b)] for s in self.steps]
        inputs: list[list[Message]] = [[] for _ in steps]
        holds_later: set[tuple[int, int]] = set()  # (rank, kv owner) needed at a later step
        for i in reversed(range(len(steps))):
            uses_kv = {(b.rank, b.kv_owner) for b in steps[i]}
            uses_q = {(b.rank, b.q_owner, b.q_rows) for b in steps[i]}
            for m in reversed(self.steps[i].inputs):
                keep = ((m.dst, m.owner) in uses_kv | holds_later if m.kind == "kv"
                        else (m.dst, m.owner, m.rows) in uses_q)
                if keep:
                    inputs[i].insert(0, m)
            holds_later |= uses_kv | {(m.src, m.owner) for m in inputs[i] if m.kind == "kv"}
        base = [Step(tuple(b), tuple(m)) for b, m in zip(steps, inputs)]
        return replace(self, steps=tuple(_with_outputs(base, self.direction)))

    def trimmed(self, visible: Callable[[Block], tuple[Rows, Rows]]) -> "Plan":
        """The plan with each block that travels cut to ``visible``'s (q rows, kv rows) inside
        it, and its messages with it: q rows as their block's, k/v as the hull of what the
        receiver reads of them (whole where it passes them on)."""
        cut = {b: replace(b, q_rows=q, kv_rows=kv) for s in self.steps for b in s.blocks
               if b.rank != b.q_owner or b.rank != b.kv_owner for q, kv in [visible(b)]}
        passed_on = {(m.src, m.owner) for s in self.steps for m in s.inputs
                     if m.kind == "kv" and m.src != m.owner}
        reads: dict[tuple[int, int], Rows] = {}  # (rank, kv owner) -> the hull its blocks read
        for b in (cut.get(b, b) for s in self.steps for b in s.blocks):
            got = reads.setdefault((b.rank, b.kv_owner), b.kv_rows)
            reads[(b.rank, b.kv_owner)] = Rows(min(got.start, b.kv_rows.start),
                                               max(got.stop, b.kv_rows.stop))
        steps = []
        for s in self.steps:
            q_rows = {(b.rank, b.q_owner, b.q_rows): cut[b].q_rows for b in s.blocks if b in cut}
            inputs = (replace(m, rows=q_rows.get((m.dst, m.owner, m.rows), m.rows)) if m.kind == "q"
                      else m if (m.dst, m.owner) in passed_on
                      else replace(m, rows=reads.get((m.dst, m.owner), m.rows)) for m in s.inputs)
            steps.append(Step(tuple(cut.get(b, b) for b in s.blocks), tuple(inputs)))
        return replace(self, steps=tuple(_with_outputs(steps, self.direction)))

    def validate(self) -> None:
        """ValueError unless every block finds its inputs and every forwarded k/v arrived first."""
        holds = {(r, r): ALL for r in range(self.world_size)}  # (rank, kv owner) -> rows held

        def held(rank: int, owner: int, rows: Rows) -> bool:
            got = holds.get((rank, owner))
            return got is not None and got.start <= rows.start and rows.stop <= got.stop

        for i, step in enumerate(self.steps):
            for m in step.inputs:
                if m.kind == "kv" and not held(m.src, m.owner, m.rows):
                    raise ValueError(f"step {i}: rank {m.src} forwards k/v of {m.owner} it does not hold")
                if m.kind == "q" and m.src != m.owner:
                    raise ValueError(f"step {i}: q rows of {m.owner} sent by rank {m.src}")
            holds.update({(m.dst, m.owner): m.rows for m in step.inputs if m.kind == "kv"})
            got_q = {(m.dst, m.owner, m.rows) for m in step.inputs if m.kind == "q"}
            for b in step.blocks:
                if not held(b.rank, b.kv_owner, b.kv_rows):
                    raise ValueError(f"step {i}: {b} lacks the k/v of rank {b.kv_owner}")
                if b.rank != b.q_owner and (b.rank, b.q_owner, b.q_rows) not in got_q:
                    raise ValueError(f"step {i}: {b} lacks the q rows of rank {b.q_owner}")


def _with_outputs(steps: list[Step], direction: str) -> list[Step]:
    """Add the messages that carry each block's results to the ranks that own them."""
    out = []
    for s in steps:
        msgs = []
        for b in s.blocks:
            if b.rank != b.q_owner:
                msgs.append(Message("out" if direction == "forward" else "dq", b.rank, b.q_owner,
                                    b.q_owner, b.q_rows))
            if direction == "backward" and b.rank != b.kv_owner:
                msgs.append(Message("dkv", b.rank, b.kv_owner, b.kv_owner, b.kv_rows))
        out.append(Step(s.blocks, s.inputs, tuple(msgs)))
    return out


def _own(r: int, kv: int, q_rows: Rows = ALL, kv_rows: Rows = ALL) -> Block:
    return Block(r, r, q_rows, kv, kv_rows)


def _distflash_causal(p: int, split: Fraction, cuts: tuple[Fraction, ...]) -> list[Step]:
    if p == 1:
        return [Step((_own(0, 0),), ())]
    steps = [Step(tuple(_own(r, r, ALL, Rows(Fraction(0), cuts[r])) for r in range(p)), ())]
    for t in range(1, (p - 1) // 2 + 1):
        blocks, msgs = [], []
        for r in range(p):  # r sends to d = r + t (mod p)
            d = (r + t) % p
            if r + t < p:
                msgs.append(Message("kv", r, d, r, ALL))
                blocks.append(_own(d, r))
            else:
                msgs.append(Message("q", r, d, r, ALL))
                blocks.append(Block(d, r, ALL, d, ALL))
        steps.append(Step(tuple(blocks), tuple(msgs)))
    if p % 2 == 0:  # distance p/2: split each block by query rows between owner and kv owner
        m, blocks, msgs = p // 2, [], []
        head, tail = Rows(Fraction(0), split), Rows(split, Fraction(1))
        for r in range(m, p):
            s = r - m
            msgs += [Message("kv", s, r, s, ALL), Message("q", r, s, r, tail)]
            blocks += [_own(r, s, head), Block(s, r, tail, s, ALL)]
        steps.append(Step(tuple(blocks), tuple(msgs)))
    tails = [Rows(cuts[r], Fraction(1)) for r in range(p)]
    steps.append(Step(tuple(_own(r, r, tails[r], tails[r]) for r in range(p)), ()))
    return steps


def _direct(p: int) -> list[Step]:
    """Non-causal distflash: at step t rank r gets k, v straight from rank r − t."""
    return [Step(tuple(_own(r, (r - t) % p) for r in range(p)),
                 tuple(Message("kv", (r - t) % p, r, (r - t) % p, ALL) for r in range(p) if t))
            for t in range(p)]


def _ring(p: int, causal: bool) -> list[Step]:
    """At step t rank r computes (q_r, kv_{r−t}); k, v travel one neighbour per step."""
    steps = []
    for t in range(p):
        ranks = [r for r in range(p) if r >= t or not causal]
        msgs = tuple(Message("kv", (r - 1) % p, r, (r - t) % p, ALL) for r in ranks if t)
        steps.append(Step(tuple(_own(r, (r - t) % p) for r in ranks), msgs))
    return steps


class Schedule:
    """A named schedule for ``world_size`` ranks; see the module docstring."""

    def __init__(self, world_size: int, kind: str):
        self.layout = schedule_layout(kind)
        seq_chunks(world_size, self.layout)  # checks the world size
        self.world_size, self.kind = world_size, kind

    def __repr__(self) -> str:
        return f"Schedule(world_size={self.world_size}, kind={self.kind!r}, layout={self.layout!r})"

    def plan(self, direction: str = "forward", causal: bool = True, split: Fraction = HALF,
             cuts: tuple[Fraction, ...] | None = None) -> Plan:
        """The per-step plan; ``direction`` is "forward" or "backward"; ``split`` (in (0, 1)):
        where distflash cuts the query rows of its distance-P/2 blocks; ``cuts`` (one per rank,
        in (0, 1), default ½): where it cuts each rank's diagonal block (module docstring)."""
        if direction not in DIRECTIONS:
            raise ValueError(f"unknown direction {direction!r}; choose forward or backward")
        cuts = (HALF,) * self.world_size if cuts is None else tuple(Fraction(c) for c in cuts)
        if len(cuts) != self.world_size:
            raise ValueError(f"cuts needs one value per rank ({self.world_size}), got {len(cuts)}")
        for name, value in (("split", split), *(("a cut", c) for c in cuts)):
            if not 0 < value < 1:
                raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")
        return _plan(self.world_size, self.kind, direction, causal, Fraction(split), cuts)

    def work_per_rank(self, causal: bool = True) -> list[float]:
        """Attention work of each rank in units of one full (chunk × chunk) block (diagonal = ½)."""
        work = [0] * self.world_size  # exact integers (see _twice_area), then float
        for step in self.plan("forward", causal).steps:
            for b in step.blocks:
                work[b.rank] += _twice_area(b, self.world_size, self.layout, causal)
        unit = 2 * (4 * chunks_per_rank(self.layout)) ** 2
        return [w / unit for w in work]

    def balance(self, causal: bool = True) -> float:
        """max / mean of :meth:`work_per_rank` (1.0 is perfect)."""
        work = self.work_per_rank(causal)
        return max(work) * len(work) / sum(work)


@functools.lru_cache(maxsize=256)
def _plan(p: int, kind: str, direction: str, causal: bool, split: Fraction,
          cuts: tuple[Fraction, ...]) -> Plan:
    if kind == "distflash":
        steps = _distflash_causal(p, split, cuts) if causal else _direct(p)
    else:
        steps = _ring(p, causal and kind == "ring")
    plan = Plan(direction, p, schedule_layout(kind), causal, tuple(_with_outputs(steps, direction)))
    plan.validate()
    return plan


def _twice_area(b: Block, world_size: int, layout: str, causal: bool) -> int:
    """2 × the visible area of a block, on a virtual local length where all Rows are exact."""
    local = 4 * chunks_per_rank(layout)
    n = local * world_size
    twice = 0
    for _, q0, ql in local_spans(n, world_size, b.q_owner, layout, *b.q_rows.resolve(local)):
        for _, k0, kl in local_spans(n, world_size, b.kv_owner, layout, *b.kv_rows.resolve(local)):
            twice += _twice_causal_area(q0, ql, k0, kl) if causal else 2 * ql * kl
    return twice


def _twice_causal_area(q0: int, ql: int, k0: int, kl: int) -> int:
    """2 × ∫ over x in [q0, q0+ql) of |{y in [k0, k0+kl) : y ≤ x}| dx (continuous; an integer)."""
    def prim(x: int) -> int:  # 2 × ∫_{-inf}^{x} clamp(u - k0, 0, kl) du
        if x <= k0:
            return 0
        if x <= k0 + kl:
            return (x - k0) ** 2
        return kl * kl + 2 * kl * (x - k0 - kl)
    return prim(q0 + ql) - prim(q0)


def make_schedule(world_size: int, kind: str = "distflash") -> Schedule:
    """The schedule ``kind`` for ``world_size`` ranks (any P ≥ 1): ``.layout`` is the layout
    ``shard`` must use, ``.work_per_rank()`` the causal work, ``.plan()`` the steps.

    Raises:
        ValueError: unknown kind or a world size below 1.
    """
    return Schedule(world_size, kind)
