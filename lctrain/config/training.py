"""The ``train`` and ``checkpoint`` sections of a recipe: how the run trains and saves.

Part of the typed recipe (`lctrain.config.schema`, which assembles the sections into a
`RecipeConfig` and checks the rules that span them); the field types come from
:mod:`lctrain.config.fields`, the ranges are checked here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lctrain.config.fields import MEMORY, SIZE, check_fields, require, suggest
from lctrain.config.tiers import parse_layer_policies

CHECKPOINTING_POLICIES = ("none", "full", "remat", "remat-offload")
"""Activation checkpointing policies (``train.checkpointing``), implemented by
`lctrain.parallel.activation_checkpoint` and modelled by `lctrain.memory`."""

REPORT_TO = ("jsonl", "tensorboard")
"""Where a run's metrics go (``train.report_to``): metrics.jsonl, TensorBoard event files."""

CHECKPOINTING_CHOICES = (*CHECKPOINTING_POLICIES, "auto")
"""``train.checkpointing`` values: a policy for every layer, or ``auto`` — a policy per layer
(`lctrain.config.tiers`), chosen by the memory model or given as ``train.layer_policies``."""

STATE_OFFLOADS = ("none", "optimizer", "all")
"""``train.state_offload`` values: what of the training state lives in host memory."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The optimisation loop."""

    seed: int = 0
    """Seed for model init, data order and everything random (0 to 2³² − 1)."""
    max_steps: int | None = None
    """Optimizer steps to run; null = as many as train.epochs gives. With both set, the run
    stops at whichever comes first."""
    epochs: float | None = None
    """Passes over the packed rows (fractions allowed): the run lasts ceil(epochs × rows /
    rows per step) steps; null = train.max_steps decides (one epoch when both are null)."""
    batch_size: int = 1
    """Packed sequences per dp rank per micro-step."""
    grad_accum: int = 1
    """Micro-steps accumulated per optimizer step."""
    lr: float = 2e-5
    """Peak learning rate (AdamW)."""
    warmup_steps: int = 0
    """Linear warm-up steps; then cosine decay to lr × min_lr_ratio at max_steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """Compute dtype: bf16 autocast / FSDP2 bf16 params, no, or auto (bf16 on GPUs that have it)."""
    checkpointing: Literal[CHECKPOINTING_CHOICES] = "none"
    """Activation checkpointing per decoder layer: none, full (recompute everything), remat
    (recompute all but the distributed attention, whose output and LSE are kept),
    remat-offload (remat with saved activations in host memory), or auto: each layer its own
    of remat / remat-offload / full / full-offload, GPU first, then host memory, then
    recompute — chosen at start by the memory model, or given by train.layer_policies."""
    layer_policies: str | None = None
    """With checkpointing auto: the layers' policies in forward order as POLICY=COUNT runs,
    e.g. full-offload=4,remat-offload=16,remat=12 (counts add up to the layers); null = the
    memory model chooses for this GPU and host memory."""
    offload_prefetch: bool = True
    """With layers whose kept tensors wait in host memory (remat-offload, full-offload), bring
    each one's back while the layer above it runs its backward, so the copy overlaps compute;
    false: when its own recompute starts, which holds one such layer on the GPU instead of two
    and waits for each copy (``lctrain estimate-memory --plan`` turns it off where that is what
    reaches the longest length)."""
    state_offload: Literal[STATE_OFFLOADS] = "none"
    """Where parameters, gradients and AdamW states live: none (the GPU), optimizer (AdamW's
    two states in pinned host memory, streamed through the GPU for the update), all
    (parameters, gradients and states in host memory through FSDP2's CPU offload; the update
    runs on the CPU)."""
    planned: str | None = None
    """What the settings were planned for (``lctrain estimate-memory --plan`` writes it into
    its --set line); the training banner repeats it."""
    host_memory: int | None = field(default=None, metadata=MEMORY)
    """Host memory per machine that remat-offload may pin, e.g. 240GiB; null = MemAvailable
    of /proc/meminfo, which reads too low on virtual machines whose memory grows as it is used."""
    loss_chunk_tokens: int = field(default=4096, metadata=SIZE)
    """Tokens per chunk of the chunked cross-entropy (bounds the fp32 logits held at once)."""
    tile_tokens: int = field(default=0, metadata=SIZE)
    """Run each decoder layer's MLP and norms over the local tokens in tiles of this many
    (recomputed per tile in the backward), so their working memory stops growing with the
    tokens per GPU; 0 = untiled. Same results; one more MLP forward per step."""
    log_every: int = 1
    """Log metrics every N optimizer steps."""
    collective_timeout: float = 1800.0
    """Seconds a rank may wait in one operation of a step (a collective, one decoder layer's
    forward or backward, a checkpoint save) before the run is stopped with the operation and
    the ranks that did not arrive named (a stopped, frozen or dead rank); long enough for the
    slowest layer and save."""
    max_nonfinite_steps: int = 5
    """Steps in a row whose loss or gradient norm is not finite (their updates are skipped)
    after which the run stops with an error."""
    eval_every: int = 0
    """Compute the validation loss (data.eval_source / data.eval_fraction) every N optimizer
    steps and after the last; 0 = only after the last."""
    report_to: tuple[str, ...] = REPORT_TO
    """Where metrics go, from rank 0: ``jsonl`` (output_dir/metrics.jsonl) and/or
    ``tensorboard`` (event files beside it, for ``tensorboard --logdir``)."""
    output_dir: str = "runs/lctrain"
    """Folder for config.yaml, metrics.jsonl and checkpoints/."""

    def __post_init__(self) -> None:
        check_fields(self, "train")
        for name in ("batch_size", "grad_accum", "loss_chunk_tokens", "log_every"):
            value = getattr(self, name)
            require(value >= 1, f"train.{name}", f"is {value} but must be at least 1")
        if self.layer_policies is not None:
            parse_layer_policies(self.layer_policies)
            require(self.checkpointing == "auto", "train.layer_policies",
                    f"is set but train.checkpointing is {self.checkpointing}; set "
                    "train.checkpointing=auto to give each layer its policy")
        require(self.tile_tokens >= 0, "train.tile_tokens",
                f"is {self.tile_tokens} but must be 0 (untiled) or a number of tokens per tile")
        require(self.max_steps is None or self.max_steps >= 1, "train.max_steps",
                f"is {self.max_steps} but must be at least 1 (or null to train by epochs)")
        require(self.epochs is None or self.epochs > 0, "train.epochs",
                f"is {self.epochs} but must be positive (or null to train by max_steps)")
        require(self.warmup_steps >= 0, "train.warmup_steps", f"is {self.warmup_steps} but must be ≥ 0")
        require(0 <= self.seed < 2**32, "train.seed",
                f"is {self.seed} but must be between 0 and {2**32 - 1} (numpy's seed range)")
        require(self.lr > 0, "train.lr", f"is {self.lr} but must be positive")
        require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio",
                f"is {self.min_lr_ratio} but must be between 0 and 1")
        require(self.weight_decay >= 0, "train.weight_decay", f"is {self.weight_decay} but must be ≥ 0")
        require(all(0 <= b < 1 for b in self.betas), "train.betas",
                f"are {list(self.betas)} but each must be in [0, 1)")
        require(self.max_grad_norm >= 0, "train.max_grad_norm",
                f"is {self.max_grad_norm} but must be ≥ 0 (0 = no clipping)")
        require(self.output_dir != "", "train.output_dir", "is empty; name a folder")
        require(self.host_memory is None or self.host_memory > 0, "train.host_memory",
                f"is {self.host_memory} but must be positive (or null to read /proc/meminfo)")
        require(self.collective_timeout >= 1, "train.collective_timeout",
                f"is {self.collective_timeout} but must be at least 1 (seconds)")
        require(self.max_nonfinite_steps >= 1, "train.max_nonfinite_steps",
                f"is {self.max_nonfinite_steps} but must be at least 1")
        require(self.eval_every >= 0, "train.eval_every",
                f"is {self.eval_every} but must be ≥ 0 (0 = after the last step only)")
        require(len(self.report_to) > 0, "train.report_to", "is empty; list jsonl and/or tensorboard")
        for i, name in enumerate(self.report_to):
            require(name in REPORT_TO, f"train.report_to[{i}]", f"is {name!r} but must be jsonl or "
                    f"tensorboard{suggest(name, REPORT_TO)}")
            require(self.report_to.count(name) == 1, "train.report_to", f"names {name} twice")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When training state is saved (atomically) under output_dir/checkpoints/."""

    every: int = 0
    """Save every N optimizer steps; 0 = only at the end."""
    keep: int = 2
    """Keep the last K checkpoints, deleting older ones."""
    enabled: bool = True
    """False: never save (benchmarks, throw-away runs); --resume then has nothing to resume."""
    export_final: bool = True
    """At the end of training also write output_dir/final/, a Hugging Face folder of the last
    checkpoint as ``lctrain export`` writes it (full weights; the adapter for a LoRA run).
    Needs ``enabled``."""
    on_signal: bool = True
    """When SIGTERM, SIGINT (Ctrl-C) or SIGHUP stops the run, save a checkpoint of the last
    completed step before exiting (needs ``enabled``)."""
    asynchronous: Literal["auto", "on", "off"] = "auto"
    """Write checkpoints in the background while training goes on (a host copy of the state
    is taken first; at most one save in flight); auto = on for GPU runs, off on the CPU."""

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint")
        require(self.every >= 0, "checkpoint.every", f"is {self.every} but must be ≥ 0 (0 = at the end)")
        require(self.keep >= 1, "checkpoint.keep", f"is {self.keep} but must be at least 1")
