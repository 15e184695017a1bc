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
   gradients, attention buffers, gathered parameters and their unsharded gradients);
2. optimizer: parameters, optimizer states, all gradients, and the foreach AdamW temporaries
   (one more parameter-sized buffer).

A LoRA run (``lora``, `lctrain.memory.lora`) keeps the frozen base model's parameters plus its
adapters and fully trained copies; gradients, optimizer states, FSDP2 gradient buffers and the
AdamW temporaries exist for those trainable parameters only, the frozen output head needs no
gradient in the loss, and the layers keep fewer activations.

``other`` gathers the transients of the peak plus allocator headroom: 5 % fragmentation (the
caching allocator's reserved minus allocated) and 1 GiB for the CUDA context, NCCL and cuBLAS
workspaces, which torch's allocator does not see. ``details["peak_allocated"]`` is the figure to
compare with ``torch.cuda.max_memory_allocated()``.
"""
from __future__ import annotations

from dataclasses import dataclass

from lctrain.errors import UserError
from lctrain.memory import activations as act
from lctrain.memory.arch import Architecture
from lctrain.memory.lora import LoraShape, layer_trainable, root_trainable, trainable_parameters
from lctrain.memory.report import MemoryEstimate

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FRAGMENTATION = 0.05
"""Share of the peak that the caching allocator reserves beyond what is allocated."""
CONTEXT_BYTES = 1 << 30
"""CUDA context, NCCL communicators and cuBLAS workspaces (outside torch's allocator)."""
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
    fsdp: bool = True
    loss_chunk_tokens: int = 4096
    lora: LoraShape | None = None

    def __post_init__(self) -> None:
        if self.policy not in act.POLICIES:
            raise UserError(f"checkpointing policy {self.policy!r} is unknown; choose one of "
                            f"{', '.join(act.POLICIES)}")
        for name in ("dtype", "master_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise UserError(f"{name} {getattr(self, name)!r} is not one of "
                                f"{', '.join(DTYPE_BYTES)}")
        if self.gpus < 1 or self.cp < 1 or self.gpus % self.cp:
            raise UserError(f"{self.gpus} GPUs cannot be split into context-parallel groups of "
                            f"{self.cp}; use a cp that divides the number of GPUs")

    @property
    def shard(self) -> int:
        """How many ranks share each parameter (FSDP2 over all GPUs; 1 = replicated)."""
        return self.gpus if self.fsdp and self.gpus > 1 else 1

    @property
    def trainable_parameters(self) -> int:
        """Parameters with gradients and optimizer state: all, or a LoRA run's adapters and
        fully trained copies."""
        if self.lora is None:
            return self.arch.parameters()
        return trainable_parameters(self.arch, self.lora)


def breakdown(setup: Setup, seq_len: int) -> tuple[dict[str, int], dict]:
    """Per-GPU bytes at ``seq_len``: (per_gpu_bytes, details) as in `MemoryEstimate`."""
    arch, c, m = setup.arch, DTYPE_BYTES[setup.dtype], DTYPE_BYTES[setup.master_dtype]
    tokens = setup.batch_size * seq_len // setup.cp
    lora, trainable = setup.lora, setup.trainable_parameters
    params = -(-(arch.parameters() + (trainable if lora else 0)) * m // setup.shard)
    grads_all = -(-trainable * m // setup.shard)  # only trainable weights have gradients ...
    optimizer = 2 * grads_all  # ... and AdamW states
    gathered, layer_grads, root = _fsdp_buffers(setup, c)
    saved = act.saved_activations(arch, tokens, c, setup.policy, lora)
    loss = act.loss_workspace(arch, tokens, c, setup.loss_chunk_tokens, head_grad=lora is None)
    attention = act.attention_workspace(arch, tokens, c, setup.cp)
    layer_backward = act.layer_backward(arch, tokens, c, setup.policy, setup.cp,
                                        lora) + layer_grads
    transient = root + gathered + max(loss, layer_backward + root)
    grads_now = grads_all if setup.grad_accum > 1 else 0
    activation_peak = params + optimizer + grads_now + saved + transient
    optimizer_peak = params + optimizer + grads_all + grads_all  # + foreach temporaries
    if activation_peak >= optimizer_peak:
        phase, grads, other, peak = "activations", grads_now, transient, activation_peak
        saved_now = saved
    else:
        phase, grads, other, peak = "optimizer", grads_all, params, optimizer_peak
        saved_now = 0
    headroom = int(FRAGMENTATION * peak) + CONTEXT_BYTES
    per_gpu = {"parameters": params, "gradients": grads, "optimizer": optimizer,
               "activations": saved_now, "other": other + headroom}
    per_gpu["total"] = sum(per_gpu.values())
    details = {"phase": phase, "tokens_per_gpu": tokens, "shard_degree": setup.shard,
               "peak_allocated": peak, "headroom": headroom, "saved_activations": saved,
               "loss_workspace": loss, "attention_workspace": attention,
               "layer_backward": layer_backward, "fsdp_gathered": gathered + root,
               "host_offload": act.host_offload(arch, tokens, c, setup.policy),
               "trainable_parameters": trainable}
    if lora is not None:
        details["lora_rank"] = lora.rank
    return per_gpu, details


def _fsdp_buffers(setup: Setup, c: int) -> tuple[int, int, int]:
    """(gathered layer parameters: current + prefetched, one layer's unsharded gradients plus
    its fp32 reduce-scatter input, the gathered root unit) in bytes; zeros when replicated."""
    if setup.shard == 1:
        return 0, 0, 0
    arch, lora = setup.arch, setup.lora
    layer = arch.layer_parameters()
    root = arch.embedding_parameters() + arch.hidden_size
    if lora is None:
        return 2 * layer * c, layer * (c + 4), root * c
    layer_lora = layer_trainable(arch, lora)  # adapters and copies: the unit's only gradients
    return (2 * (layer + layer_lora) * c, layer_lora * (c + 4),
            (root + root_trainable(arch, lora)) * c)


def max_seq_len(setup: Setup, gpu_memory: int, seq_chunks: int) -> int:
    """Largest multiple of ``seq_chunks`` whose estimated total fits in ``gpu_memory`` (0 if none).

    Memory grows with the sequence length, so a doubling search brackets the limit and a binary
    search over multiples of ``seq_chunks`` finds it.
    """
    def fits(units: int) -> bool:
        return breakdown(setup, units * seq_chunks)[0]["total"] <= gpu_memory

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
"""Share of a machine's available host memory that remat-offload may pin (the rest is left to
the processes themselves, the page cache and the data loader)."""


def host_offload_fits(per_gpu: int, processes: int, host_memory: int) -> bool:
    """Whether ``processes`` GPU processes parking ``per_gpu`` pinned bytes each fit in
    ``host_memory`` bytes of one machine (see :data:`HOST_USABLE`)."""
    return per_gpu * processes <= HOST_USABLE * host_memory


def _host_max_seq_len(seq_len: int, per_gpu: int, processes: int, host_memory: int,
                      chunks: int) -> int | None:
    """Longest multiple of ``chunks`` whose parked bytes fit the host (None: nothing parked).
    The parked bytes grow linearly with the tokens per GPU."""
    if per_gpu <= 0:
        return None
    longest = int(seq_len * HOST_USABLE * host_memory / (per_gpu * processes))
    return longest // chunks * chunks


def estimate(arch: Architecture, seq_len: int, gpus: int, cp: int, policy: str,
             dtype: str = "bfloat16", *, master_dtype: str = "float32", batch_size: int = 1,
             grad_accum: int = 1, fsdp: bool = True, loss_chunk_tokens: int = 4096,
             gpu_memory: int | None = None, seq_chunks: int | None = None,
             host_memory: int | None = None, gpus_per_node: int | None = None,
             lora: LoraShape | None = None) -> MemoryEstimate:
    """Estimate the per-GPU memory of training ``arch`` at ``seq_len`` tokens per sequence.

    Args:
        arch: the model's shapes (`lctrain.memory.load_architecture`).
        seq_len: tokens per sequence (the whole sequence, before the cp split).
        gpus: GPUs in the job (dp × cp); FSDP2 shards over all of them.
        cp: context-parallel degree (ranks sharing one sequence).
        policy: checkpointing policy: none | full | remat | remat-offload.
        dtype: compute dtype ("bfloat16", "float16" or "float32").
        master_dtype: dtype the sharded parameters, gradients and AdamW states are kept in.
        batch_size: sequences per dp rank per micro-step.
        grad_accum: micro-steps per optimizer step (> 1 keeps gradients through the backward).
        fsdp: shard parameters, gradients and optimizer states (False: every GPU holds all).
        loss_chunk_tokens: tokens per chunk of the chunked cross-entropy.
        gpu_memory: bytes per GPU; when given, ``fits`` and ``max_seq_len`` are filled in.
        seq_chunks: the layout's chunking (cp, or 2·cp for zigzag); max_seq_len is a multiple.
        host_memory: host bytes of one machine; when given (with gpu_memory), ``fits`` and
            ``max_seq_len`` also require remat-offload's pinned bytes of the machine's
            processes to fit in it (:func:`host_offload_fits`).
        gpus_per_node: GPU processes per machine (default: min(gpus, 8)).
        lora: a LoRA run's adapters and fully trained modules (`lctrain.memory.lora_shape`);
            None trains every weight.

    Returns:
        A `MemoryEstimate`.

    Raises:
        UserError: an unknown policy or dtype, cp not dividing gpus, or seq_len not a positive
            multiple of the layout's chunking.
    """
    setup = Setup(arch=arch, gpus=gpus, cp=cp, policy=policy, dtype=dtype,
                  master_dtype=master_dtype, batch_size=batch_size, grad_accum=grad_accum,
                  fsdp=fsdp, loss_chunk_tokens=loss_chunk_tokens, lora=lora)
    chunks = seq_chunks or cp
    if seq_len <= 0 or seq_len % chunks:
        raise UserError(f"sequence length {seq_len} must be a positive multiple of {chunks} (the "
                        f"layout cuts each sequence into {chunks} equal chunks)")
    if gpus_per_node is not None and gpus_per_node > gpus:
        raise UserError(f"--gpus-per-node {gpus_per_node} is more than the {gpus} GPUs of the "
                        f"job (--gpus); give at most {gpus} GPUs per machine")
    per_gpu, details = breakdown(setup, seq_len)
    fits = None if gpu_memory is None else per_gpu["total"] <= gpu_memory
    longest = None if gpu_memory is None else max_seq_len(setup, gpu_memory, chunks)
    if host_memory is not None:
        local = gpus_per_node or min(gpus, 8)
        details["host_offload_per_node"] = details["host_offload"] * local
        host_ok = host_offload_fits(details["host_offload"], local, host_memory)
        host_longest = _host_max_seq_len(seq_len, details["host_offload"], local, host_memory,
                                         chunks)
        if fits is not None:
            fits = fits and host_ok
            longest = longest if host_longest is None else min(longest, host_longest)
    return MemoryEstimate(model=arch.name, parameters_count=arch.parameters(), seq_len=seq_len,
                          gpus=gpus, cp=cp, policy=policy, dtype=dtype, master_dtype=master_dtype,
                          gpu_memory=gpu_memory, host_memory=host_memory,
                          per_gpu_bytes=per_gpu, details=details,
                          fits=fits, max_seq_len=longest)
