"""The ``train`` and ``checkpoint`` sections of a recipe: how the run trains and saves."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lctrain.config.fields import MEMORY, SIZE, at_least, check_fields, require
from lctrain.config.layers import LayerPlan

MAX_TIMEOUT = 1e8
"""The longest ``train.collective_timeout`` in seconds (torch's process groups fail at once on
about 1e10: a C++ overflow)."""
REPORT_TO = ("jsonl", "tensorboard", "wandb", "mlflow")
"""Where a run's metrics may go (``train.report_to``): metrics.jsonl, TensorBoard event files,
Weights & Biases, MLflow."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimisation loop."""

    seed: int = 0
    """Seed for model init, data order, the held-out documents and everything random."""
    max_steps: int | None = field(default=None, metadata=at_least(1, " (or null to train by epochs)"))
    """Optimizer steps to run; null: as train.epochs gives (the first limit wins)."""
    epochs: float | None = None
    """Passes over the packed rows; null: train.max_steps decides (one epoch if both null)."""
    batch_size: int = field(default=1, metadata=at_least(1))
    """Packed sequences per data-parallel rank per micro-step."""
    grad_accum: int = field(default=1, metadata=at_least(1))
    """Micro-steps accumulated per optimizer step."""
    lr: float = 2e-5
    """Peak learning rate (AdamW)."""
    warmup_steps: int = field(default=0, metadata=at_least(0))
    """Linear warm-up steps; then cosine decay to lr × min_lr_ratio at max_steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    weight_decay: float = field(default=0.0, metadata=at_least(0))
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    max_grad_norm: float = field(default=1.0, metadata=at_least(0, " (0 = no clipping)"))
    """Clip the global gradient norm to this; 0 = no clipping."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """Compute dtype: bf16 autocast / FSDP2 bf16 params, no, or auto (bf16 on GPUs that have it)."""
    checkpointing: str = "none"
    """How each layer is kept for its backward: none, remat, full, auto or runs such as
    full=4,remat=28 (`lctrain.config.layers`)."""
    offload: str = "none"
    """What waits in host memory: none, or layers / layers=N, and optimizer or state."""
    host_memory: int | None = field(default=None, metadata=MEMORY)
    """Host memory per machine, e.g. 240GiB; null: MemAvailable of /proc/meminfo."""
    loss_chunk_tokens: int = field(default=4096, metadata=SIZE | at_least(1))
    """Tokens per chunk of the chunked cross-entropy (bounds the fp32 logits held at once); the
    fused loss of ``model.fused_kernels`` on GPUs sizes its own chunks."""
    tile_tokens: int = field(default=0, metadata=SIZE | at_least(0, " (0 = untiled)"))
    """Run each layer's MLP and norms in tiles of this many tokens; 0 = untiled."""
    collective_timeout: float = field(default=1800.0, metadata=at_least(1, " (seconds)"))
    """Seconds a rank may wait in one operation of a step before the run stops, naming it."""
    max_nonfinite_steps: int = field(default=5, metadata=at_least(1))
    """Skipped non-finite steps in a row after which the run stops."""
    eval_every: int = field(default=0, metadata=at_least(0, " (0 = after the last step only)"))
    """Compute the validation loss every N optimizer steps and after the last; 0 = the last."""
    report_to: tuple[Literal[REPORT_TO], ...] = ("jsonl", "tensorboard")
    """Where metrics go: jsonl (output_dir/metrics.jsonl), tensorboard, wandb, mlflow."""
    output_dir: str = "runs/lctrain"
    """Folder for config.yaml, metrics.jsonl and checkpoints/."""

    def __post_init__(self) -> None:
        check_fields(self, "train")
        plan = LayerPlan.parse(self.checkpointing, self.offload)
        object.__setattr__(self, "checkpointing", plan.checkpointing)  # the parsed form
        object.__setattr__(self, "offload", plan.offload)
        require(self.epochs is None or self.epochs > 0, "train.epochs",
                f"is {self.epochs} but must be positive (or null to train by max_steps)")
        require(0 <= self.seed < 2**32, "train.seed",
                f"is {self.seed} but must be between 0 and {2**32 - 1} (numpy's seed range)")
        require(self.collective_timeout <= MAX_TIMEOUT, "train.collective_timeout",
                f"is {self.collective_timeout:g} but must be at most {MAX_TIMEOUT:g} seconds "
                "(about 3 years); torch's process groups fail at once on far longer ones")
        require(self.lr > 0, "train.lr", f"is {self.lr} but must be positive")
        require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio",
                f"is {self.min_lr_ratio} but must be between 0 and 1")
        require(all(0 <= b < 1 for b in self.betas), "train.betas",
                f"are {list(self.betas)} but each must be in [0, 1)")
        require(self.output_dir != "", "train.output_dir", "is empty; name a folder")
        require(self.host_memory is None or self.host_memory > 0, "train.host_memory",
                f"is {self.host_memory} but must be positive (or null to read /proc/meminfo)")
        require(len(self.report_to) > 0, "train.report_to",
                f"is empty; list some of {', '.join(REPORT_TO)}")
        for name in self.report_to:
            require(self.report_to.count(name) == 1, "train.report_to", f"names {name} twice")

    @property
    def layers(self) -> LayerPlan:
        """train.checkpointing and train.offload, parsed."""
        return LayerPlan.parse(self.checkpointing, self.offload)


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When training state is saved under output_dir/checkpoints/ (background on GPUs)."""

    every: int = field(default=0, metadata=at_least(0, " (0 = at the end)"))
    """Save every N optimizer steps; 0 = only at the end."""
    keep: int = field(default=2, metadata=at_least(0, " (0 = never save)"))
    """Keep the last K checkpoints; 0 = never save (nothing to resume or export)."""
    export_final: bool = True
    """At the end also write output_dir/final/, as ``lctrain export`` writes it."""

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint")

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are saved at all (keep > 0)."""
        return self.keep > 0
