"""`MemoryEstimate`: the result of the memory model, as JSON (the CLI renders it)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-GPU memory of one training step (see `lctrain.memory.estimate`).

    Attributes:
        model: architecture label (preset name, path or model_type).
        parameters_count: all parameters of the model.
        seq_len, gpus, cp, policy, dtype, master_dtype: the setup estimated.
        gpu_memory: bytes per GPU the estimate was checked against (None: not checked).
        host_memory: host bytes per machine checked for remat-offload's pinned memory (None:
            not checked).
        per_gpu_bytes: parameters, gradients, optimizer, activations, other (transients and
            allocator headroom) and their total, at the step's peak.
        details: how the peak was reached: phase ("activations" or "optimizer"),
            tokens_per_gpu, shard_degree, peak_allocated (compare with
            torch.cuda.max_memory_allocated), headroom, the transient parts, and host_offload
            (pinned host bytes per process under remat-offload; with host_memory also
            host_offload_per_node).
        fits: total ≤ gpu_memory, and the machine's pinned bytes within host_memory when given
            (None when no gpu_memory was given).
        max_seq_len: the longest sequence (a multiple of the layout's chunking) that fits;
            0 if none does; None when no gpu_memory was given.
    """

    model: str
    parameters_count: int
    seq_len: int
    gpus: int
    cp: int
    policy: str
    dtype: str
    master_dtype: str
    gpu_memory: int | None
    per_gpu_bytes: dict[str, int]
    details: dict = field(default_factory=dict)
    host_memory: int | None = None
    fits: bool | None = None
    max_seq_len: int | None = None

    def to_json(self) -> dict:
        """A JSON-ready dict; ``per_gpu_bytes`` keys are the components plus ``total``."""
        return {
            "model": self.model, "parameters_count": self.parameters_count,
            "seq_len": self.seq_len, "gpus": self.gpus, "cp": self.cp, "policy": self.policy,
            "dtype": self.dtype, "master_dtype": self.master_dtype,
            "gpu_memory": self.gpu_memory, "host_memory": self.host_memory,
            "per_gpu_bytes": dict(self.per_gpu_bytes),
            "details": dict(self.details), "fits": self.fits, "max_seq_len": self.max_seq_len,
        }
