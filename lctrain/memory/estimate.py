"""Per-GPU memory of one training step: the larger of its two peaks (the activations at the
end of the forward, the optimizer's update) with its parts; ``peak_allocated`` compares with
``torch.cuda.max_memory_allocated()`` (``first_step_peak`` for a run of one step, before AdamW
has made its states), ``host_offload`` is one process's pinned memory."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lctrain.config.layers import LayerPlan
from lctrain.errors import UserError
from lctrain.memory import activations as act
from lctrain.memory.arch import Architecture
from lctrain.memory.adapters import LoraShape, layer_trainable, root_trainable, trainable_parameters
from lctrain.memory.placement import place
from lctrain.memory.tables import MemoryEstimate
from lctrain.memory.timing import step_seconds

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FRAGMENTATION = 0.05
"""Share of the peak that the caching allocator reserves beyond what is allocated."""
CONTEXT_BYTES = 1 << 30
"""CUDA context, NCCL communicators and cuBLAS workspaces (outside torch's allocator)."""
STREAM_BYTES = 5 << 28
"""GPU buffers of an optimizer step whose AdamW states live in host memory (`HostAdamW`)."""
_MAX_SEARCH_TOKENS = 1 << 32


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything but the sequence length that decides a step's memory."""

    arch: Architecture
    gpus: int
    cp: int
    layers: LayerPlan = LayerPlan()
    dtype: str = "bfloat16"
    master_dtype: str = "float32"
    batch_size: int = 1
    grad_accum: int = 1
    fsdp: bool | str = True
    loss_chunk_tokens: int = 4096
    lora: LoraShape | None = None
    tile_tokens: int = 0
    head_groups: int = 1
    gpu_memory: int | None = None
    host_budget: int | None = None
    attended: float = 1.0  # share of one document's pairs a step's busiest row attends (time)

    def __post_init__(self) -> None:
        if isinstance(self.layers, str):
            object.__setattr__(self, "layers", LayerPlan.parse(self.layers))
        for name in ("dtype", "master_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise UserError(f"{name} {getattr(self, name)!r} is not one of "
                                f"{', '.join(DTYPE_BYTES)}")
        if self.gpus < 1 or self.cp < 1 or self.gpus % self.cp:
            raise UserError(f"{self.gpus} GPUs cannot be split into context-parallel groups of "
                            f"{self.cp}; use a cp that divides the number of GPUs")
        kv = self.arch.num_kv_heads
        if self.head_groups < 1 or kv % self.head_groups:
            raise UserError(f"head_groups {self.head_groups} must divide the model's {kv} "
                            "key/value heads")
        if not self.layers.auto:
            self.layers.parked_layers(self.arch.num_layers)  # the counts add up
        elif self.gpu_memory is None:
            raise UserError("checkpointing auto places layers by the GPU's memory; give the GPU "
                            "memory (--gpu-memory) or the layers' runs")

    @property
    def shard(self) -> int:
        """How many ranks share each parameter (FSDP2 over all GPUs; 1 = replicated)."""
        return self.gpus if self.fsdp and self.gpus > 1 else 1


def breakdown(setup: Setup, seq_len: int) -> tuple[dict[str, int], dict]:
    """Per-GPU bytes at ``seq_len``: (per_gpu_bytes, details) as in `MemoryEstimate`."""
    arch, c, m = setup.arch, DTYPE_BYTES[setup.dtype], DTYPE_BYTES[setup.master_dtype]
    tokens = setup.batch_size * seq_len // setup.cp
    lora, trainable = setup.lora, trainable_parameters(arch, setup.lora)
    params = -(-(arch.parameters() + (trainable if lora else 0)) * m // setup.shard)
    grads_all = -(-trainable * m // setup.shard)  # only trainable weights have gradients ...
    optimizer = 2 * grads_all  # ... and AdamW states
    offload = setup.layers.state
    host_state = {"none": 0, "optimizer": optimizer, "state": params + grads_all + optimizer}[offload]
    if offload == "state":  # the GPU holds FSDP2's gathered units only
        params = grads_all = optimizer = 0
    gpu_optimizer = optimizer if offload == "none" else 0
    grads_now = grads_all if setup.grad_accum > 1 else 0
    fixed = params + gpu_optimizer + grads_now
    plan = _placed(setup, tokens, c, fixed, host_state) if setup.layers.auto else setup.layers
    kinds, parked = plan.kinds(arch.num_layers), plan.parked_layers(arch.num_layers)
    parts = _activation_phase(setup, tokens, c, kinds, parked, _grads_made(setup, c, m))
    activation_peak = fixed + parts["saved_now"] + parts["transient"]
    optimizer_peak = params + gpu_optimizer + grads_all + {  # + the update's temporaries
        "none": grads_all, "optimizer": STREAM_BYTES, "state": 0}[offload]
    if activation_peak >= optimizer_peak:
        phase, peak = "activations", activation_peak  # gradients: also those made by then
        grads, other = grads_now + parts["grads_made"], parts["transient"] - parts["grads_made"]
        saved_now = parts["saved_now"]
    else:
        phase, grads, saved_now, peak = "optimizer", grads_all, 0, optimizer_peak
        other = peak - params - gpu_optimizer - grads_all
    headroom = int(FRAGMENTATION * peak) + CONTEXT_BYTES
    per_gpu = {"parameters": params, "gradients": grads, "optimizer": gpu_optimizer,
               "activations": saved_now, "other": other + headroom}
    per_gpu["total"] = sum(per_gpu.values())
    host_activations = act.host_offload(arch, tokens, c, kinds, parked)
    details = {"phase": phase, "tokens_per_gpu": tokens, "shard_degree": setup.shard,
               "peak_allocated": peak, "headroom": headroom,
               # a run's first step: AdamW makes its states at the update, after activations
               "first_step_peak": max(activation_peak - gpu_optimizer, optimizer_peak),
               "saved_activations": parts["saved"],
               "loss_workspace": parts["loss"], "attention_workspace": parts["attention"],
               "layer_backward": parts["layer_backward"], "fsdp_gathered": parts["gathered"],
               "host_offload": host_activations + host_state,
               "host_activations": host_activations, "host_state": host_state,
               "trainable_parameters": trainable, "tile_tokens": setup.tile_tokens,
               "head_groups": setup.head_groups, "checkpointing": plan.checkpointing,
               "offload": plan.offload}
    if lora is not None:
        details["lora_rank"] = lora.rank
    return per_gpu, details


def _grads_made(setup: Setup, c: int, m: int) -> list[int]:
    """Gradient bytes already made when each layer's backward runs: the head's (unsharded, in
    the compute dtype, until the root unit's reduce-scatter at the end) and, unless they are
    all held anyway (accumulation) or sent to the host (FSDP2's offload), the sharded ones of
    the layers above."""
    arch, lora, layers = setup.arch, setup.lora, setup.arch.num_layers
    head = arch.vocab_size * arch.hidden_size * c if lora is None else 0
    if setup.grad_accum > 1 or setup.layers.state == "state":
        return [head] * layers
    per_layer = arch.layer_parameters() if lora is None else layer_trainable(arch, lora)
    return [head + -(-(layers - 1 - i) * per_layer * m // setup.shard) for i in range(layers)]


def _activation_phase(setup: Setup, tokens: int, c: int, kinds, parked,
                      made: list[int]) -> dict[str, int]:
    """The activation peak beyond the fixed parts: the larger of the loss's backward and the
    worst layer's backward beside what is still kept then and the gradients ``made`` by then
    (a transient)."""
    parts = _transients(setup, tokens, c, set(kinds))
    backward, final_norm, gathered = parts["backward"], parts["final_norm"], parts["gathered"]
    kept = [act.kept_bytes(setup.arch, tokens, c, k, setup.lora, setup.tile_tokens,
                           setup.head_groups) for k in kinds]
    during = act.kept_during_layers(kept, list(parked))
    at = max(range(len(kinds)), key=lambda i: during[i] + backward[kinds[i]] + made[i])
    saved = max(during) + final_norm
    loss_moment = (saved, gathered + parts["loss"])
    # the final norm's kept tensors are gone by the time the first layer's backward runs
    layer_moment = (during[at] + final_norm, gathered + made[at]
                    + max(backward[kinds[at]] + parts["root"] - final_norm, 0))
    saved_now, transient = max(loss_moment, layer_moment, key=sum)
    grads_made = made[at] if (saved_now, transient) == layer_moment else 0
    return {**parts, "saved": saved, "saved_now": saved_now, "transient": transient,
            "grads_made": grads_made}


def _transients(setup: Setup, tokens: int, c: int, kinds: set[str]) -> dict:
    """The transients at the activation peak: the loss's or the worst layer backward, gathers;
    with each kind's layer backward, the root's gather and the final norm's kept bytes."""
    arch, lora = setup.arch, setup.lora
    gathered, layer_grads, root = _fsdp_buffers(setup, c)
    loss = act.loss_workspace(arch, tokens, c, setup.loss_chunk_tokens, head_grad=lora is None)
    backward = {kind: act.layer_backward(arch, tokens, c, kind, setup.cp, lora, setup.tile_tokens,
                                         setup.head_groups) + layer_grads for kind in kinds}
    final_norm = act.final_norm_saved(arch, tokens, c, lora, setup.tile_tokens)
    layer_phase = max(max(backward.values()) + root - final_norm, 0)
    groups = setup.head_groups  # the attention's own buffers: all heads', or one head group's
    attention = (act.grouped_workspace if act.grouped(arch, lora, groups)
                 else act.attention_workspace)(arch, tokens, c, setup.cp, groups)
    return {"transient": root + gathered + max(loss, layer_phase), "loss": loss,
            "attention": attention, "layer_backward": max(backward.values()),
            "gathered": gathered + root, "root": root, "backward": backward,
            "final_norm": final_norm}


def _placed(setup: Setup, tokens: int, c: int, fixed: int, host_state: int) -> LayerPlan:
    """``auto``'s placement in what the peak leaves, then the host budget; where every layer is
    remat on the GPU, the top layers kept whole (no recompute) while the peak stays in it."""
    arch, layers = setup.arch, setup.arch.num_layers
    host_room = (setup.host_budget or 0) - host_state
    limit = int((setup.gpu_memory - CONTEXT_BYTES) / (1 + FRAGMENTATION))  # peak with headroom
    made = _grads_made(setup, c, DTYPE_BYTES[setup.master_dtype])
    found = None
    for assumed in ({"remat"}, {"remat", "full"}):
        parts = _transients(setup, tokens, c, assumed)
        room = limit - fixed - parts["final_norm"] - parts["transient"] - made[-1]
        found = place(arch, tokens, c, room, host_room, made[0] - made[-1])
        if found is None or not any(name == "full" for name, _ in found[0]):
            break
    if found is None:
        return setup.layers.placed((("full", layers),), layers)
    if found != ((("remat", layers),), 0):
        return setup.layers.placed(*found)

    def peak(whole: int) -> int:
        kinds = ("remat",) * (layers - whole) + ("none",) * whole
        parts = _activation_phase(setup, tokens, c, kinds, (False,) * layers, made)
        return fixed + parts["saved_now"] + parts["transient"]

    whole = 0
    while whole < layers and peak(whole + 1) <= limit:
        whole += 1
    runs = tuple((kind, n) for kind, n in (("remat", layers - whole), ("none", whole)) if n)
    return setup.layers.placed(runs, 0)


def _fsdp_buffers(setup: Setup, c: int) -> tuple[int, int, int]:
    """Bytes of gathered layers, one layer's unsharded gradients and the gathered root."""
    if not (setup.shard > 1 or setup.layers.state == "state" or setup.fsdp == "on"):
        return 0, 0, 0  # FSDP2 gathers no unit before use: neither sharded nor offloaded
    arch, lora = setup.arch, setup.lora
    layer = arch.layer_parameters()
    root = arch.embedding_parameters() + arch.hidden_size
    if lora is None:
        return 2 * layer * c, layer * (c + 4), root * c
    layer_lora = layer_trainable(arch, lora)  # adapters and copies: the unit's only gradients
    return (2 * (layer + layer_lora) * c, layer_lora * (c + 4),
            (root + root_trainable(arch, lora)) * c)


def max_seq_len(setup: Setup, gpu_memory: int, seq_chunks: int,
                host_budget: int | None = None) -> int:
    """Largest multiple of ``seq_chunks`` that fits ``gpu_memory`` (and ``host_budget``); 0: none."""
    def fits(units: int) -> bool:
        per_gpu, details = breakdown(setup, units * seq_chunks)
        return per_gpu["total"] <= gpu_memory and (
            host_budget is None or details["host_offload"] <= host_budget)

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
        if high * seq_chunks > _MAX_SEARCH_TOKENS:
            return low * seq_chunks
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * seq_chunks


HOST_USABLE = 0.9
"""Share of a machine's available host memory that may be pinned."""


def host_offload_fits(per_gpu: int, processes: int, host_memory: int) -> bool:
    """Whether ``processes`` pinning ``per_gpu`` bytes each fit one machine's ``host_memory``."""
    return per_gpu * processes <= HOST_USABLE * host_memory


def host_budget(host_memory: int | None, processes: int) -> int | None:
    """Pinned bytes one of ``processes`` GPU processes may use on a machine of ``host_memory``."""
    return None if host_memory is None else int(HOST_USABLE * host_memory / max(processes, 1))


def divisors(n: int) -> list[int]:
    """``n``'s divisors in increasing order, found up to √n (the cp sizes of n GPUs)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def check_gpus_per_node(gpus: int, gpus_per_node: int | None) -> None:
    """UserError: more GPUs per machine than the job has."""
    if gpus_per_node is not None and gpus_per_node > gpus:
        raise UserError(f"--gpus-per-node {gpus_per_node} is more than the {gpus} GPUs of the "
                        f"job (--gpus); give at most {gpus} GPUs per machine")


def estimate(arch: Architecture, seq_len: int, gpus: int, cp: int, layers: LayerPlan | str,
             dtype: str = "bfloat16", *, seq_chunks: int | None = None,
             host_memory: int | None = None, gpus_per_node: int | None = None,
             **setup) -> MemoryEstimate:
    """Estimate the per-GPU memory of training ``arch`` at ``seq_len`` (a multiple of
    ``seq_chunks``, default cp; ``setup``: `Setup`'s other fields). UserError: a bad setting."""
    local = gpus_per_node or min(gpus, 8)
    budget = host_budget(host_memory, local)
    setup = Setup(arch=arch, gpus=gpus, cp=cp, layers=layers, dtype=dtype, host_budget=budget,
                  **setup)
    chunks, gpu_memory = seq_chunks or cp, setup.gpu_memory
    if seq_len <= 0 or seq_len % chunks:
        raise UserError(f"sequence length {seq_len} must be a positive multiple of {chunks} (the "
                        f"layout cuts each sequence into {chunks} equal chunks)")
    check_gpus_per_node(gpus, gpus_per_node)
    per_gpu, details = breakdown(setup, seq_len)
    placed = LayerPlan.parse(details["checkpointing"], details["offload"])
    details["step_seconds"] = step_seconds(dataclasses.replace(setup, layers=placed), seq_len,
                                           details)
    details["attended"] = setup.attended
    fits = None if gpu_memory is None else per_gpu["total"] <= gpu_memory
    longest = None if gpu_memory is None else max_seq_len(setup, gpu_memory, chunks, budget)
    if host_memory is not None:
        details["host_offload_per_node"] = details["host_offload"] * local
        if fits is not None:
            fits = fits and host_offload_fits(details["host_offload"], local, host_memory)
    return MemoryEstimate(model=arch.name, parameters_count=arch.parameters(), seq_len=seq_len,
                          gpus=gpus, cp=cp, policy=setup.layers.checkpointing, dtype=dtype,
                          master_dtype=setup.master_dtype, gpu_memory=gpu_memory,
                          host_memory=host_memory, per_gpu_bytes=per_gpu, details=details,
                          fits=fits, max_seq_len=longest)
