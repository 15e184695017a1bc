"""The planner behind ``lctrain estimate-memory --plan``: the longest sequence a machine can
train, the settings that reach it, and the fastest settings that fit a given length.

An *option* is one way to run a recipe on the machine: the context-parallel degree (dp = GPUs /
cp), the checkpointing policy (``none``, or ``auto``: each layer not checkpointed, or remat or
full with its kept tensors on the GPU or in pinned host memory, placed by
`lctrain.memory.tiers`), tiled MLP and norms, attention head groups, and where the training
state lives (``train.state_offload``). Every option is judged by the memory model
(`lctrain.memory.estimate.breakdown`): the GPU total must fit the GPU, and all pinned bytes of a
machine's processes its host memory (`lctrain.memory.estimate.HOST_USABLE` of it).

Longest: for every cp and state placement, ``auto`` with tiles and the most head groups (each
only lowers memory), searched for the longest length (rounded down to a whole K of tokens);
the longest wins, the cheapest breaks a tie. Fastest at a length: every cp × state placement ×
policy × tiling × head groups; the cheapest wins (head groups cost little and free memory
that would otherwise be bought with recomputation).

Cost (:func:`step_seconds`): a documented estimate of one step's time, used only to rank:

- compute at :data:`GPU_FLOPS` (an H100/H200-class GPU at 45 % MFU): the model's 6·N FLOPs per
  token, attention (causal forward 2·S²·Hq·d per layer, backward 2.5×) per GPU (÷ cp), plus what
  the options recompute: the forward of each checkpointed (not ``none``) layer's projections
  and MLP, the attention forward of each full layer, one more MLP forward per tiled layer, and
  one more forward of the lower layer of each ``full-paired`` pair, and with the projections
  in head groups (`lctrain.model.grouped_attention`) one more q/k/v projection of each layer
  that is not remat (remat's recompute skips them, so its count is unchanged);
- pinned-memory copies (out and back) at :data:`PCIE_BYTES`, overlapped with compute: the step
  takes the longer of the two; without prefetching (``train.offload_prefetch: false``, one
  offloaded layer on the GPU at a time instead of two) the copies back are waited for;
- state in host memory, not overlapped: ``optimizer`` moves both AdamW states in and out per
  step; ``all`` also gathers the parameters twice (forward and backward), moves the gradients
  out and runs the update on the CPU at :data:`HOST_UPDATE_BYTES` of state per second;
- communication that overlap does not hide: :data:`CP_OVERHEAD` per doubling of cp; and
  :data:`GROUP_OVERHEAD` for attention in head groups (any number of them: each group's inputs
  and results are copied once, whatever the count).

So the ranking prefers, in effect: no checkpointing > remat > remat in host memory >
recomputing the attention; and a larger cp only where it saves memory that would otherwise cost
time.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lctrain.config.tiers import format_layer_policies, parse_layer_policies
from lctrain.memory.activations import grouped
from lctrain.memory.estimate import Setup, breakdown, host_budget, max_seq_len
from lctrain.memory.tiers import (chained_layers, recomputed_layers, remat_layers,
                                  unchecked_layers)

GPU_FLOPS = 0.45 * 989e12
"""Assumed useful FLOP/s of one GPU (an H100/H200 at 45 % of its dense bf16 peak)."""
PCIE_BYTES = 25e9
"""Assumed host <-> GPU copy rate per GPU and direction (PCIe 5 x16, pinned memory)."""
HOST_UPDATE_BYTES = 4e9
"""Assumed rate of an AdamW update on the CPU, in bytes of state (master weights, gradients,
both moments) per second per process."""
CP_OVERHEAD = 0.02
"""Step time added per doubling of cp (communication that overlap does not hide)."""
GROUP_OVERHEAD = 0.005
"""Step time added by running the attention in head groups (copies of each group's inputs and
results), a bound on what 1 and 8 groups measure apart on long sequences."""
TILE_TOKENS = 8192
"""Tokens per tile of the MLP and norms when a plan tiles them."""
STATE_OFFLOADS = ("none", "optimizer", "all")


@dataclass(frozen=True)
class Machine:
    """The hardware a plan is for.

    Attributes:
        gpus: GPUs in the job; gpu_memory: bytes per GPU; host_memory: host bytes per machine
        (None: nothing may be placed in host memory); gpus_per_node: GPU processes per machine.
    """

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
    """One option at one length: its memory estimate and estimated step time.

    Attributes:
        setup: the memory model's setup of the option (auto placement resolved into runs).
        seq_len: tokens per sequence.
        per_gpu, details: `lctrain.memory.estimate.breakdown` at that length.
        step_s: estimated seconds per step (:func:`step_seconds`); tokens_s: tokens per second
            of the whole job.
    """

    setup: Setup
    seq_len: int
    per_gpu: dict
    details: dict
    step_s: float
    tokens_s: float

    def overrides(self) -> list[str]:
        """The recipe settings of this choice, as ``--set`` items (key=value)."""
        s = self.setup
        items = [f"parallel.cp={s.cp}", f"train.checkpointing={s.policy}"]
        if s.policy == "auto":
            items.append(f"train.layer_policies={self.details['layer_policies']}")
        items += [f"train.tile_tokens={s.tile_tokens}", f"parallel.head_groups={s.head_groups}",
                  f"train.state_offload={s.state_offload}"]
        return items + ([] if s.offload_prefetch else ["train.offload_prefetch=false"])

    def to_json(self) -> dict:
        s = self.setup
        return {"seq_len": self.seq_len, "cp": s.cp, "dp": s.gpus // s.cp,
                "checkpointing": s.policy, "layer_policies": self.details.get("layer_policies"),
                "tile_tokens": s.tile_tokens, "head_groups": s.head_groups,
                "state_offload": s.state_offload, "offload_prefetch": s.offload_prefetch,
                "per_gpu_bytes": dict(self.per_gpu),
                "peak_allocated": self.details["peak_allocated"],
                "host_offload": self.details["host_offload"], "step_s": self.step_s,
                "tokens_per_s": self.tokens_s, "overrides": self.overrides()}


def options(base: Setup, machine: Machine, *, longest: bool) -> list[Setup]:
    """The options to weigh (see the module docstring); ``longest``: only the ones that can
    reach furthest (auto, tiled, the most head groups)."""
    kv = base.arch.num_kv_heads
    groups = [g for g in range(1, kv + 1) if kv % g == 0]
    found = []
    for cp in (d for d in range(1, machine.gpus + 1) if machine.gpus % d == 0):
        for offload in STATE_OFFLOADS:
            if offload != "none" and machine.host_memory is None:
                continue
            policies = ("auto",) if longest else ("none", "auto")
            tiles = (TILE_TOKENS,) if longest else (0, TILE_TOKENS)
            for policy in policies:
                for tile in tiles:
                    for prefetch in ((True, False) if machine.host_memory else (True,)):
                        found.append(dataclasses.replace(
                            base, gpus=machine.gpus, cp=cp, policy=policy, tile_tokens=tile,
                            head_groups=groups[-1] if longest else 1, runs=None,
                            state_offload=offload, offload_prefetch=prefetch,
                            gpu_memory=machine.gpu_memory, host_budget=machine.host_budget))
    return found


def choose(setup: Setup, seq_len: int, machine: Machine) -> Choice | None:
    """The option at ``seq_len`` with its ``auto`` placement fixed, or None if it does not fit."""
    per_gpu, details = breakdown(setup, seq_len)
    if per_gpu["total"] > machine.gpu_memory or details["host_offload"] > machine.host_budget:
        return None
    if setup.policy == "auto":
        setup = dataclasses.replace(setup, runs=parse_layer_policies(details["layer_policies"]))
    step = step_seconds(setup, seq_len, details)
    tokens = seq_len * setup.batch_size * setup.gpus // setup.cp
    return Choice(setup, seq_len, per_gpu, details, step, tokens / step)


def longest(base: Setup, machine: Machine, seq_chunks) -> Choice | None:
    """The longest sequence any option fits, with the cheapest option reaching it.

    Args:
        seq_chunks: ``cp -> chunks`` of the recipe's layout (lengths are multiples of it).
    """
    best: Choice | None = None
    for setup in options(base, machine, longest=True):
        chunks = seq_chunks(setup.cp)
        length = max_seq_len(setup, machine.gpu_memory, chunks, machine.host_budget)
        step = math.lcm(chunks, 1024)  # a length as people write it (a whole K) where one fits
        length = length // step * step if length >= step else length
        found = choose(setup, length, machine) if length else None
        if found is not None and (best is None or found.seq_len > best.seq_len or (
                found.seq_len == best.seq_len and _key(found) < _key(best))):
            best = found
    return best


def fastest(base: Setup, machine: Machine, seq_len: int, seq_chunks) -> Choice | None:
    """The cheapest option that fits ``seq_len`` (None when none does)."""
    kv = base.arch.num_kv_heads
    best: Choice | None = None
    for setup in options(base, machine, longest=False):
        if seq_len % seq_chunks(setup.cp):
            continue
        for groups in (g for g in range(1, kv + 1) if kv % g == 0):
            found = choose(dataclasses.replace(setup, head_groups=groups), seq_len, machine)
            if found is not None and (best is None or _key(found) < _key(best)):
                best = found
    return best


def _key(choice: Choice) -> tuple:
    """Ranking: estimated time per token, then less host memory, smaller cp, fewer groups,
    no tiles, prefetching."""
    s = choice.setup
    return (round(1 / choice.tokens_s, 12), choice.details["host_offload"], s.cp, s.head_groups,
            s.tile_tokens, not s.offload_prefetch)


def step_seconds(setup: Setup, seq_len: int, details: dict) -> float:
    """Estimated seconds of one optimizer step of ``setup`` at ``seq_len`` (module docstring)."""
    arch = setup.arch
    tokens = details["tokens_per_gpu"] * setup.grad_accum
    layers, h, inter = arch.num_layers, arch.hidden_size, arch.intermediate_size
    mlp = 3 * h * inter
    projections = arch.layer_parameters() - mlp  # attention projections and norms
    linear = 6 * (layers * arch.layer_parameters() + arch.vocab_size * h) * tokens
    attention_fwd = 2 * seq_len ** 2 * arch.q_width / setup.cp * setup.batch_size * setup.grad_accum
    runs = setup.runs or ()
    checkpointed = 0 if setup.policy == "none" else layers - unchecked_layers(runs)
    recompute = 2 * checkpointed * (projections + mlp) * tokens
    recompute += recomputed_layers(runs) * attention_fwd
    recompute += chained_layers(runs) * (attention_fwd + 2 * (projections + mlp) * tokens)
    tiles = 2 * layers * mlp * tokens if 0 < setup.tile_tokens < details["tokens_per_gpu"] else 0
    if grouped(arch, setup.lora, setup.head_groups):
        qkv = 2 * h * (arch.q_width + 2 * arch.kv_width) * tokens
        recompute += qkv * (layers - remat_layers(runs))
    compute = (linear + layers * 3.5 * attention_fwd + recompute + tiles) / GPU_FLOPS
    copies = 2 * details["host_activations"] * setup.grad_accum / PCIE_BYTES
    if setup.offload_prefetch:
        seconds = max(compute, copies)
    else:  # the copies back wait: each layer's comes when its recompute starts
        seconds = max(compute, copies / 2) + copies / 2
    seconds += _state_seconds(setup, details)
    overhead = CP_OVERHEAD * math.log2(setup.cp) + GROUP_OVERHEAD * (setup.head_groups > 1)
    return seconds * (1 + overhead)


def _state_seconds(setup: Setup, details: dict) -> float:
    """Per-step time of training state in host memory (not overlapped with compute)."""
    state = details["host_state"]
    if setup.state_offload == "optimizer":
        return 2 * state / PCIE_BYTES
    if setup.state_offload == "all":
        params = state / 4  # master weights: a quarter of (weights, gradients, two moments)
        return (3 * params) / PCIE_BYTES + state / HOST_UPDATE_BYTES
    return 0.0


def describe(choice: Choice) -> str:
    """One line: the settings of a choice in words."""
    s = choice.setup
    policy = s.policy if s.policy == "none" else f"auto ({format_layer_policies(s.runs)})"
    return (f"cp {s.cp} x dp {s.gpus // s.cp}, checkpointing {policy}, tile_tokens "
            f"{s.tile_tokens}, head_groups {s.head_groups}, state_offload {s.state_offload}"
            + ("" if s.offload_prefetch else ", offload_prefetch false"))


def plan(base: Setup, machine: Machine, seq_chunks, seq_len: int | None = None) -> dict:
    """The longest choice and, for ``seq_len``, the fastest one, as JSON-ready data.

    Args:
        base: the recipe's setup (model, dtypes, batch, LoRA, loss chunks); the planner varies
            cp, checkpointing, tiles, head groups and state placement.
        machine: GPUs, their memory, the host memory.
        seq_chunks: ``cp -> chunks`` of the recipe's layout.
        seq_len: a length to find the fastest settings for (None: only the longest).

    Returns:
        ``{"model", "parameters_count", "machine": {...}, "longest": choice | None,
        "fastest": choice | None, "seq_len": seq_len}`` (choices as `Choice.to_json`).
    """
    best = longest(base, machine, seq_chunks)
    quick = fastest(base, machine, seq_len, seq_chunks) if seq_len else None
    return {"model": base.arch.name, "parameters_count": base.arch.parameters(),
            "machine": dataclasses.asdict(machine), "seq_len": seq_len,
            "longest": best.to_json() if best else None,
            "fastest": quick.to_json() if quick else None}
