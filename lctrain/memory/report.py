"""`MemoryEstimate`: the result of the memory model, as JSON and as a table."""
from __future__ import annotations

from dataclasses import dataclass, field

COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "other")
_GIB = float(1 << 30)


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

    def table(self):
        """A rich Table: one row per component with GiB and share of the total."""
        from rich.table import Table

        total = self.per_gpu_bytes["total"]
        title = (f"{self.model} ({self.parameters_count / 1e9:.2f} B parameters): "
                 f"{self.seq_len} tokens, {self.gpus} GPU(s), cp {self.cp}, {self.policy}")
        table = Table(title=title, caption=self._caption())
        table.add_column("per GPU")
        table.add_column("GiB", justify="right")
        table.add_column("share", justify="right")
        for name in COMPONENTS:
            value = self.per_gpu_bytes[name]
            table.add_row(name, f"{value / _GIB:.2f}", f"{100 * value / total:.0f} %")
        table.add_row("total", f"{total / _GIB:.2f}", "100 %", style="bold")
        return table

    def _caption(self) -> str:
        phase = self.details.get("phase", "?")
        text = f"peak at the {phase} phase; {self.details.get('tokens_per_gpu', '?')} tokens per GPU"
        if self.details.get("lora_rank"):
            text += (f"; LoRA rank {self.details['lora_rank']}: "
                     f"{self.details['trainable_parameters'] / 1e6:.1f} M trainable parameters")
        if self.details.get("host_offload"):
            text += f"; {self.details['host_offload'] / _GIB:.1f} GiB pinned host memory per GPU"
        if self.gpu_memory is None:
            return text
        verdict = "fits" if self.fits else "does NOT fit"
        where = f"{self.gpu_memory / _GIB:.1f} GiB per GPU"
        if self.host_memory is not None and self.details.get("host_offload"):
            where += (f" and {self.host_memory / _GIB:.0f} GiB of host memory per machine "
                      f"({self.details['host_offload_per_node'] / _GIB:.0f} GiB pinned)")
        longest = (f"longest that fits: {self.max_seq_len} tokens" if self.max_seq_len
                   else "no sequence length fits")
        return f"{verdict} in {where}; {longest}; {text}"
