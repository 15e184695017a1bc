"""The planner behind ``estimate-memory --plan``: the longest sequence a machine can train and
the fastest settings at a length, over cp × state × checkpointing × tiles × head groups,
judged by the memory model and ranked by the step-time model (`lctrain.memory.timing`)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lctrain.config.layers import STATES, LayerPlan
from lctrain.memory.estimate import Setup, breakdown, divisors, host_budget, max_seq_len
from lctrain.memory.timing import step_seconds

TILE_TOKENS = 8192
"""Tokens per tile of the MLP and norms when a plan tiles them."""


@dataclass(frozen=True)
class Machine:
    """The hardware a plan is for (``host_memory`` None: nothing in host memory)."""

    gpus: int
    gpu_memory: int
    host_memory: int | None
    gpus_per_node: int

    @property
    def host_budget(self) -> int:
        """Pinned bytes one GPU process may use (0 without host memory)."""
        return host_budget(self.host_memory, self.gpus_per_node) or 0


@dataclass(frozen=True)
class Choice:
    """One option at one length: its setup (``auto`` resolved), breakdown, step time, tokens/s."""

    setup: Setup
    seq_len: int
    per_gpu: dict
    details: dict
    step_s: float
    tokens_s: float

    def overrides(self) -> list[str]:
        """The recipe settings of this choice, as ``--set`` items (key=value)."""
        s = self.setup
        return [f"parallel.cp={s.cp}", f"train.checkpointing={s.layers.checkpointing}",
                f"train.offload={s.layers.offload}", f"train.tile_tokens={s.tile_tokens}",
                f"parallel.head_groups={s.head_groups}"]

    def to_json(self) -> dict:
        s = self.setup
        return {"seq_len": self.seq_len, "cp": s.cp, "dp": s.gpus // s.cp,
                "checkpointing": s.layers.checkpointing, "offload": s.layers.offload,
                "tile_tokens": s.tile_tokens, "head_groups": s.head_groups,
                "per_gpu_bytes": dict(self.per_gpu),
                "peak_allocated": self.details["peak_allocated"],
                "host_offload": self.details["host_offload"], "step_s": self.step_s,
                "tokens_per_s": self.tokens_s, "overrides": self.overrides()}


def options(base: Setup, machine: Machine, *, longest: bool) -> list[Setup]:
    """The options to weigh; ``longest``: only those that reach furthest."""
    found = []
    for cp in divisors(machine.gpus):
        for state in STATES if machine.host_memory is not None else STATES[:1]:
            if state == "state" and base.fsdp is False:  # FSDP2's CPU offload needs FSDP2
                continue
            for policy in ("auto",) if longest else ("none", "auto"):
                for tile in (TILE_TOKENS,) if longest else (0, TILE_TOKENS):
                    layers = LayerPlan(LayerPlan.parse(policy).runs, 0, state)
                    found.append(dataclasses.replace(
                        base, gpus=machine.gpus, cp=cp, layers=layers, tile_tokens=tile,
                        head_groups=base.arch.num_kv_heads if longest else 1,
                        gpu_memory=machine.gpu_memory, host_budget=machine.host_budget))
    return found


def choose(setup: Setup, seq_len: int, machine: Machine) -> Choice | None:
    """The option at ``seq_len`` with its ``auto`` placement fixed, or None if it does not fit."""
    per_gpu, details = breakdown(setup, seq_len)
    if per_gpu["total"] > machine.gpu_memory or details["host_offload"] > machine.host_budget:
        return None
    setup = dataclasses.replace(setup, layers=LayerPlan.parse(details["checkpointing"],
                                                              details["offload"]))
    step = step_seconds(setup, seq_len, details)
    tokens = seq_len * setup.batch_size * setup.grad_accum * setup.gpus // setup.cp
    return Choice(setup, seq_len, per_gpu, details, step, tokens / step)


def longest(base: Setup, machine: Machine, seq_chunks) -> Choice | None:
    """The longest length any option fits, with the cheapest option reaching it."""
    found = []
    for setup in options(base, machine, longest=True):
        chunks = seq_chunks(setup.cp)
        length = max_seq_len(setup, machine.gpu_memory, chunks, machine.host_budget)
        step = math.lcm(chunks, 1024)  # a length as people write it (a whole K) where one fits
        length = length // step * step if length >= step else length
        found.append(choose(setup, length, machine) if length else None)
    return min((c for c in found if c is not None), key=lambda c: (-c.seq_len, _key(c)),
               default=None)


def fastest(base: Setup, machine: Machine, seq_len: int, seq_chunks) -> Choice | None:
    """The cheapest option that fits ``seq_len`` (None when none does)."""
    kv = base.arch.num_kv_heads
    found = (choose(dataclasses.replace(setup, head_groups=groups), seq_len, machine)
             for setup in options(base, machine, longest=False)
             if seq_len % seq_chunks(setup.cp) == 0
             for groups in range(1, kv + 1) if kv % groups == 0)
    return min((c for c in found if c is not None), key=_key, default=None)


def _key(choice: Choice) -> tuple:
    """Ranking: time per token, then less host memory, smaller cp, fewer groups, no tiles."""
    s = choice.setup
    return (round(1 / choice.tokens_s, 12), choice.details["host_offload"], s.cp, s.head_groups,
            s.tile_tokens)


def plan(base: Setup, machine: Machine, seq_chunks, seq_len: int | None = None) -> dict:
    """The longest choice and the fastest at ``seq_len`` (None: none), as JSON-ready data."""
    best = longest(dataclasses.replace(base, attended=1.0), machine, seq_chunks)
    quick = fastest(base, machine, seq_len, seq_chunks) if seq_len else None
    return {"model": base.arch.name, "parameters_count": base.arch.parameters(),
            "machine": dataclasses.asdict(machine), "seq_len": seq_len,
            "attended": base.attended,
            "longest": best.to_json() if best else None,
            "fastest": quick.to_json() if quick else None}
