"""Per-GPU memory of one training step: the analytic model behind ``lctrain estimate-memory``.

Precision scheme (what the training loop runs): parameters are stored in ``master_dtype`` and
sharded by FSDP2 over ALL gpus (dp × cp); AdamW keeps two states of the same dtype; gradients are
reduce-scattered (in fp32) into the same sharded dtype. Compute runs in ``dtype``: FSDP2 all-gathers
each layer's parameters in that dtype just before use (the current layer and one prefetched),
and the root unit (embeddings, final norm, output head) stays gathered for the whole step.

The step has two peaks, and the larger one is reported with the breakdown of that moment:

1. activations: the end of the forward / start of the backward — parameters, optimizer states,
   gradients only if they accumulate over micro-steps, every saved activation, and the larger of
   the chunked loss's working set and one layer's backward working set (recompute, activation
   gradients, attention buffers, gathered parameters and their unsharded gradients), less the
   final norm's kept tensors, which the loss's backward has freed by then;
2. optimizer: parameters, optimizer states, all gradients, and the foreach AdamW temporaries
   (one more parameter-sized buffer).

A LoRA run (``lora``, `lctrain.memory.lora`) keeps the frozen base model's parameters plus its
adapters and fully trained copies; gradients, optimizer states, FSDP2 gradient buffers and the
AdamW temporaries exist for those trainable parameters only, the frozen output head needs no
gradient in the loss, and the layers keep fewer activations.

Long-context parts (each modelled where it acts): tiled MLP and norms (``tile_tokens``), the
attention in head groups (``head_groups``), per-layer policies of ``auto`` checkpointing placed
on the GPU or in pinned host memory (`lctrain.memory.tiers`), and training state in host memory
(``state_offload``): ``optimizer`` keeps AdamW's states there (the GPU keeps parameters and
gradients; the step streams the states through :data:`STREAM_BYTES` of GPU buffers), ``all``
keeps parameters, gradients and states there (FSDP2's CPU offload, even on one GPU: the GPU
holds the gathered units only; the update runs on the CPU). ``details["host_offload"]`` is all
the pinned memory of one process.

``other`` gathers the transients of the peak plus allocator headroom: 5 % fragmentation (the
caching allocator's reserved minus allocated) and 1 GiB for the CUDA context, NCCL and cuBLAS
workspaces, which torch's allocator does not see. ``details["peak_allocated"]`` is the figure to
compare with ``torch.cuda.max_memory_allocated()``.
"""
from __future__ import annotations

from dataclasses import dataclass

from lctrain.config.training import STATE_OFFLOADS
from lctrain.config.tiers import format_layer_policies, per_layer
from lctrain.errors import UserError
from lctrain.memory import activations as act
from lctrain.memory.arch import Architecture
from lctrain.memory.lora import LoraShape, layer_trainable, root_trainable, trainable_parameters
from lctrain.memory.report import MemoryEstimate
from lctrain.memory.tiers import Runs, place, with_unchecked

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FRAGMENTATION = 0.05
"""Share of the peak that the caching allocator reserves beyond what is allocated."""
CONTEXT_BYTES = 1 << 30
"""CUDA context, NCCL communicators and cuBLAS workspaces (outside torch's allocator)."""
STREAM_BYTES = 5 << 28
"""GPU buffers of an optimizer step whose AdamW states live in host memory: both states of two
chunks in flight and the update's temporaries (`lctrain.parallel.offload.HostAdamW`)."""
POLICY_CHOICES = (*act.POLICIES, "auto")
"""Policies the model takes: the uniform ones and ``auto`` (per-layer, `lctrain.memory.tiers`)."""
_MAX_SEARCH_TOKENS = 1 << 32


@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything but the sequence length that decides a step's memory (see `estimate`)."""

    arch: Architecture
    gpus: int
    cp: int
    policy: str
    dtype: str = "bfloat16"
    master_dtype: str = "float32"
    batch_size: int = 1
    grad_accum: int = 1
    fsdp: bool | str = True
    loss_chunk_tokens: int = 4096
    lora: LoraShape | None = None
    tile_tokens: int = 0
    head_groups: int = 1
    runs: Runs | None = None
    state_offload: str = "none"
    offload_prefetch: bool = True
    gpu_memory: int | None = None
    host_budget: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICY_CHOICES:
            raise UserError(f"checkpointing policy {self.policy!r} is unknown; choose one of "
                            f"{', '.join(POLICY_CHOICES)}")
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
        if self.runs is not None and sum(n for _, n in self.runs) != self.arch.num_layers:
            raise UserError(f"train.layer_policies {format_layer_policies(self.runs)} covers "
                            f"{sum(n for _, n in self.runs)} layers but the model has "
                            f"{self.arch.num_layers}; make the counts add up to it")
        if self.state_offload not in STATE_OFFLOADS:
            raise UserError(f"state_offload {self.state_offload!r} is not one of "
                            f"{', '.join(STATE_OFFLOADS)}")
        if self.policy == "auto" and self.runs is None and self.gpu_memory is None:
            raise UserError("checkpointing auto places layers by the GPU's memory; give the GPU "
                            "memory (--gpu-memory) or the layers' policies")

    @property
    def shard(self) -> int:
        """How many ranks share each parameter (FSDP2 over all GPUs; 1 = replicated)."""
        return self.gpus if self.fsdp and self.gpus > 1 else 1

    @property
    def fsdp_units(self) -> bool:
        """Whether FSDP2 gathers each unit before use (sharded, or offloaded to the host)."""
        return self.shard > 1 or self.state_offload == "all" or self.fsdp == "on"

    @property
    def trainable_parameters(self) -> int:
        """Parameters with gradients and optimizer state: all, or a LoRA run's adapters and
        fully trained copies."""
        if self.lora is None:
            return self.arch.parameters()
        return trainable_parameters(self.arch, self.lora)


def peak_limit(gpu_memory: int) -> int:
    """The largest allocated peak whose total (with headroom) fits ``gpu_memory``."""
    return int((gpu_memory - CONTEXT_BYTES) / (1 + FRAGMENTATION))


def breakdown(setup: Setup, seq_len: int) -> tuple[dict[str, int], dict]:
    """Per-GPU bytes at ``seq_len``: (per_gpu_bytes, details) as in `MemoryEstimate`."""
    arch, c, m = setup.arch, DTYPE_BYTES[setup.dtype], DTYPE_BYTES[setup.master_dtype]
    tokens = setup.batch_size * seq_len // setup.cp
    lora, trainable = setup.lora, setup.trainable_parameters
    params = -(-(arch.parameters() + (trainable if lora else 0)) * m // setup.shard)
    grads_all = -(-trainable * m // setup.shard)  # only trainable weights have gradients ...
    optimizer = 2 * grads_all  # ... and AdamW states
    offload = setup.state_offload
    host_state = {"none": 0, "optimizer": optimizer, "all": params + grads_all + optimizer}[offload]
    if offload == "all":  # the GPU holds FSDP2's gathered units only
        params = grads_all = optimizer = 0
    gpu_optimizer = optimizer if offload == "none" else 0
    grads_now = grads_all if setup.grad_accum > 1 else 0
    runs = setup.runs
    fixed = params + gpu_optimizer + grads_now
    if setup.policy == "auto" and runs is None:
        runs = _placed(setup, tokens, c, fixed, host_state)
    parts = _activation_phase(setup, tokens, c, runs)
    saved = parts["saved"]
    activation_peak = fixed + parts["saved_now"] + parts["transient"]
    optimizer_peak = params + gpu_optimizer + grads_all + {  # + the update's temporaries
        "none": grads_all, "optimizer": STREAM_BYTES, "all": 0}[offload]
    if activation_peak >= optimizer_peak:
        phase, grads, other, peak = "activations", grads_now, parts["transient"], activation_peak
        saved_now = parts["saved_now"]
    else:
        phase, grads, saved_now, peak = "optimizer", grads_all, 0, optimizer_peak
        other = peak - params - gpu_optimizer - grads_all
    headroom = int(FRAGMENTATION * peak) + CONTEXT_BYTES
    per_gpu = {"parameters": params, "gradients": grads, "optimizer": gpu_optimizer,
               "activations": saved_now, "other": other + headroom}
    per_gpu["total"] = sum(per_gpu.values())
    host_activations = act.host_offload(arch, tokens, c, setup.policy, runs)
    details = {"phase": phase, "tokens_per_gpu": tokens, "shard_degree": setup.shard,
               "peak_allocated": peak, "headroom": headroom, "saved_activations": saved,
               "loss_workspace": parts["loss"], "attention_workspace": parts["attention"],
               "layer_backward": parts["layer_backward"], "fsdp_gathered": parts["gathered"],
               "host_offload": host_activations + host_state,
               "host_activations": host_activations, "host_state": host_state,
               "trainable_parameters": trainable, "tile_tokens": setup.tile_tokens,
               "head_groups": setup.head_groups, "state_offload": offload}
    if runs is not None:
        details["layer_policies"] = format_layer_policies(runs)
    if lora is not None:
        details["lora_rank"] = lora.rank
    return per_gpu, details


def _activation_phase(setup: Setup, tokens: int, c: int, runs: Runs | None) -> dict[str, int]:
    """The activation peak beyond the fixed parts, at the larger of two moments: the loss's
    backward (every kept tensor and the final norm's, the loss's working set) and the layer
    whose backward needs most beside the kept tensors still on the GPU then
    (`lctrain.memory.activations.kept_at_each_layer`: the backward frees each layer's as it
    passes, so an unchecked layer on top is gone before the remat layers below recompute).

    Returns ``saved`` (kept tensors after the forward), ``saved_now`` and ``transient`` (kept
    and transient bytes at the peak), and the parts of `_transients`.
    """
    arch, lora, tile = setup.arch, setup.lora, setup.tile_tokens
    parts = _transients(setup, tokens, c, runs)
    gathered, layer_grads, root = _fsdp_buffers(setup, c)
    final_norm = act.final_norm_saved(arch, tokens, c, lora, tile)
    kinds = act.layer_policies(arch, setup.policy, runs)
    during = act.kept_at_each_layer(arch, tokens, c, kinds, lora, tile, setup.head_groups,
                                    setup.offload_prefetch)
    backward = {kind: act.layer_backward(arch, tokens, c, kind, setup.cp, lora, tile,
                                         setup.head_groups) + layer_grads for kind in set(kinds)}
    at = max(range(len(kinds)), key=lambda i: during[i] + backward[kinds[i]])
    saved = max(during) + final_norm
    loss_moment = (saved, root + gathered + parts["loss"])
    # the final norm's kept tensors (counted with the saved activations) are gone by the time
    # the first layer's backward runs
    layer_moment = (during[at] + final_norm,
                    root + gathered + max(backward[kinds[at]] + root - final_norm, 0))
    saved_now, transient = max(loss_moment, layer_moment, key=sum)
    return {**parts, "saved": saved, "saved_now": saved_now, "transient": transient}


def _transients(setup: Setup, tokens: int, c: int, runs: Runs | None) -> dict[str, int]:
    """The step's transients at the activation peak: the larger of the loss and one layer's
    backward (of the most demanding layer policy present), FSDP2's gathered units."""
    arch, lora = setup.arch, setup.lora
    gathered, layer_grads, root = _fsdp_buffers(setup, c)
    loss = act.loss_workspace(arch, tokens, c, setup.loss_chunk_tokens, head_grad=lora is None)
    kinds = set(per_layer(runs)) if runs is not None else {setup.policy}
    layer_backward = max(act.layer_backward(arch, tokens, c, kind, setup.cp, lora,
                                            setup.tile_tokens, setup.head_groups)
                         for kind in kinds) + layer_grads
    # the final norm's kept tensors (counted with the saved activations) are gone by the time
    # the first layer's backward runs
    final_norm = act.final_norm_saved(arch, tokens, c, lora, setup.tile_tokens)
    layer_phase = max(layer_backward + root - final_norm, 0)
    return {"transient": root + gathered + max(loss, layer_phase), "loss": loss,
            "attention": _attention_buffers(setup, tokens, c),
            "layer_backward": layer_backward, "gathered": gathered + root}


def _attention_buffers(setup: Setup, tokens: int, c: int) -> int:
    """The attention's own buffers in a layer's backward: all heads', or one head group's."""
    arch, groups = setup.arch, setup.head_groups
    if act.grouped(arch, setup.lora, groups):
        return act.grouped_workspace(arch, tokens, c, setup.cp, groups)
    return act.attention_workspace(arch, tokens, c, setup.cp, groups)


def _placed(setup: Setup, tokens: int, c: int, fixed: int, host_state: int) -> Runs:
    """``auto``'s layer policies at this length (`lctrain.memory.tiers.place`): what the GPU's
    peak leaves beside the fixed parts and the transients, then the host budget; when every
    layer is remat on the GPU, the most layers left unchecked that the step's peak allows. A
    placement that recomputes attention makes the backward larger, so it is placed again with
    that."""
    arch = setup.arch
    final_norm = act.final_norm_saved(arch, tokens, c, setup.lora, setup.tile_tokens)
    host_room = (setup.host_budget or 0) - host_state
    limit = peak_limit(setup.gpu_memory)
    runs = None
    for assumed in (("remat", 1),), (("remat", 1), ("full", 1)):
        room = limit - fixed - final_norm - _transients(setup, tokens, c, assumed)["transient"]
        runs = place(arch, tokens, c, room, host_room, in_flight=1 + setup.offload_prefetch)
        if runs is None or not any(name.startswith("full") for name, _ in runs):
            break
    if runs != (("remat", arch.num_layers),):
        return runs or (("full-offload", arch.num_layers),)

    def fits(count: int) -> bool:
        parts = _activation_phase(setup, tokens, c, with_unchecked(arch.num_layers, count))
        return fixed + parts["saved_now"] + parts["transient"] <= limit

    low, high = 0, arch.num_layers  # the most unchecked layers that fit: low fits, high + 1 not
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return with_unchecked(arch.num_layers, low)


def _fsdp_buffers(setup: Setup, c: int) -> tuple[int, int, int]:
    """(gathered layer parameters: current + prefetched, one layer's unsharded gradients plus
    its fp32 reduce-scatter input, the gathered root unit) in bytes; zeros when replicated."""
    if not setup.fsdp_units:
        return 0, 0, 0
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
    """Largest multiple of ``seq_chunks`` whose estimated total fits in ``gpu_memory`` and whose
    pinned bytes fit ``host_budget`` per process when given (0 if none).

    Memory grows with the sequence length, so a doubling search brackets the limit and a binary
    search over multiples of ``seq_chunks`` finds it.
    """
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
"""Share of a machine's available host memory that may be pinned (the rest is left to the
processes themselves, the page cache and the data loader)."""


def host_offload_fits(per_gpu: int, processes: int, host_memory: int) -> bool:
    """Whether ``processes`` GPU processes pinning ``per_gpu`` bytes each fit in
    ``host_memory`` bytes of one machine (see :data:`HOST_USABLE`)."""
    return per_gpu * processes <= HOST_USABLE * host_memory


def host_budget(host_memory: int | None, processes: int) -> int | None:
    """Pinned bytes one of ``processes`` GPU processes may use on a machine of ``host_memory``."""
    return None if host_memory is None else int(HOST_USABLE * host_memory / max(processes, 1))


def estimate(arch: Architecture, seq_len: int, gpus: int, cp: int, policy: str,
             dtype: str = "bfloat16", *, master_dtype: str = "float32", batch_size: int = 1,
             grad_accum: int = 1, fsdp: bool | str = True, loss_chunk_tokens: int = 4096,
             gpu_memory: int | None = None, seq_chunks: int | None = None,
             host_memory: int | None = None, gpus_per_node: int | None = None,
             lora: LoraShape | None = None, tile_tokens: int = 0, head_groups: int = 1,
             layer_policies: Runs | None = None, state_offload: str = "none",
             offload_prefetch: bool = True) -> MemoryEstimate:
    """Estimate the per-GPU memory of training ``arch`` at ``seq_len`` tokens per sequence.

    Args:
        arch: the model's shapes (`lctrain.memory.load_architecture`).
        seq_len: tokens per sequence (the whole sequence, before the cp split).
        gpus: GPUs in the job (dp × cp); FSDP2 shards over all of them.
        cp: context-parallel degree (ranks sharing one sequence).
        policy: checkpointing policy: none | full | remat | remat-offload | auto.
        dtype: compute dtype ("bfloat16", "float16" or "float32").
        master_dtype: dtype the sharded parameters, gradients and AdamW states are kept in.
        batch_size: sequences per dp rank per micro-step.
        grad_accum: micro-steps per optimizer step (> 1 keeps gradients through the backward).
        fsdp: shard parameters, gradients and optimizer states (False: every GPU holds all;
            "on": FSDP2 even on one GPU, whose gathered units then cost memory too).
        loss_chunk_tokens: tokens per chunk of the chunked cross-entropy.
        gpu_memory: bytes per GPU; when given, ``fits`` and ``max_seq_len`` are filled in.
        seq_chunks: the layout's chunking (cp, or 2·cp for zigzag); max_seq_len is a multiple.
        host_memory: host bytes of one machine; when given (with gpu_memory), ``fits`` and
            ``max_seq_len`` also require the pinned bytes of the machine's processes to fit
            (:func:`host_offload_fits`), and ``auto`` may place layers there.
        gpus_per_node: GPU processes per machine (default: min(gpus, 8)).
        lora: a LoRA run's adapters and fully trained modules (`lctrain.memory.lora_shape`);
            None trains every weight.
        tile_tokens: tokens per tile of the MLP and norms (0: untiled).
        head_groups: attention head groups run one after the other.
        layer_policies: ``auto``'s per-layer policies as runs (None: placed by this model
            from ``gpu_memory`` and ``host_memory``).
        state_offload: none, optimizer (AdamW's states in pinned host memory) or all
            (parameters, gradients and states there, FSDP2's CPU offload).
        offload_prefetch: offloaded layers come back while the layer above runs its backward
            (two of them on the GPU at a time); False: one.

    Returns:
        A `MemoryEstimate`.

    Raises:
        UserError: an unknown policy or dtype, cp not dividing gpus, head groups not dividing
            the key/value heads, or seq_len not a positive multiple of the layout's chunking.
    """
    local = gpus_per_node or min(gpus, 8)
    budget = host_budget(host_memory, local)
    setup = Setup(arch=arch, gpus=gpus, cp=cp, policy=policy, dtype=dtype,
                  master_dtype=master_dtype, batch_size=batch_size, grad_accum=grad_accum,
                  fsdp=fsdp, loss_chunk_tokens=loss_chunk_tokens, lora=lora,
                  tile_tokens=tile_tokens, head_groups=head_groups, runs=layer_policies,
                  state_offload=state_offload, offload_prefetch=offload_prefetch,
                  gpu_memory=gpu_memory, host_budget=budget)
    chunks = seq_chunks or cp
    if seq_len <= 0 or seq_len % chunks:
        raise UserError(f"sequence length {seq_len} must be a positive multiple of {chunks} (the "
                        f"layout cuts each sequence into {chunks} equal chunks)")
    if gpus_per_node is not None and gpus_per_node > gpus:
        raise UserError(f"--gpus-per-node {gpus_per_node} is more than the {gpus} GPUs of the "
                        f"job (--gpus); give at most {gpus} GPUs per machine")
    per_gpu, details = breakdown(setup, seq_len)
    fits = None if gpu_memory is None else per_gpu["total"] <= gpu_memory
    longest = None if gpu_memory is None else max_seq_len(setup, gpu_memory, chunks, budget)
    if host_memory is not None:
        details["host_offload_per_node"] = details["host_offload"] * local
        if fits is not None:
            fits = fits and host_offload_fits(details["host_offload"], local, host_memory)
    return MemoryEstimate(model=arch.name, parameters_count=arch.parameters(), seq_len=seq_len,
                          gpus=gpus, cp=cp, policy=policy, dtype=dtype, master_dtype=master_dtype,
                          gpu_memory=gpu_memory, host_memory=host_memory,
                          per_gpu_bytes=per_gpu, details=details,
                          fits=fits, max_seq_len=longest)
