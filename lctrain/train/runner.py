"""What runs: one rank's training, from the recipe's parts to the loop (the composition root).

    finetune(cfg, resume=False, nproc=None)   # start every rank (lctrain.train.launch.dispatch)
    run_worker(cfg, resume=False)             # what each rank runs

`run_worker` builds one rank's run in this order; each step is a function of this module that a
feature extends in one place:

    launch.worker_process      accelerate's Accelerator: process group, device, mixed precision
    → dp × cp mesh → seed → ContextParallel (how sequences are cut, which attention runs)
    → build_data               tokenize and pack once per machine into the data cache
                               (its local rank 0 prepares, the others wait and memory-map it);
                               train.epochs / train.max_steps resolved against its rows
    → build_model              the model with the schedule's attention → LoRA adapters when
                               the recipe asks → checkpointing policy
                               → FSDP2 or replication (`ModelParts`)
    → build_trainer            AdamW + warm-up/cosine; restored from a checkpoint on --resume
    → train                    banner, versions (environment.json), `LoopHooks` (metrics.jsonl,
                               progress, `save`), the loop, the summary line
    → export_final             rank 0 writes output_dir/final/ as a Hugging Face folder
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from lctrain.config import RecipeConfig, save_resolved
from lctrain.config.tiers import format_layer_policies, per_layer
from lctrain.data import (PackedRows, iter_batches, load_tokenizer, plan_steps, prepare_data,
                          rows_summary, steps_summary)
from lctrain.export import export_final as write_final
from lctrain.memory.host import available_host_bytes
from lctrain.memory.recipe import layer_policies_for
from lctrain.model import load_model
from lctrain.model.lora import apply_lora
from lctrain.model.structure import decoder_layers
from lctrain.parallel.checkpointing import apply_checkpointing
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.fsdp import Distributed, distribute
from lctrain.parallel.offload import host_memory_bytes
from lctrain.parallel.tiling import apply_tiling
from lctrain.parallel.mesh import ParallelMesh, build_mesh
from lctrain.report.versions import record_run
from lctrain.train import launch
from lctrain.train.checkpoint import load_checkpoint, resume_point, save_checkpoint
from lctrain.train.launch import default_nproc
from lctrain.train.loop import CausalLMLoss, LoopHooks, Trainer, run_loop
from lctrain.train.metrics import FlopModel, MetricsLog, Progress, peak_flops
from lctrain.train.optim import build_optimizer

__all__ = ["ModelParts", "RunSetup", "build_data", "build_model", "build_trainer", "default_nproc",
           "export_final", "finetune", "run_worker", "save", "train"]


def finetune(cfg: RecipeConfig, *, resume: bool = False, nproc: int | None = None) -> int:
    """Fine-tune as the recipe says; returns the process exit code (0 on success).

    Args:
        cfg: the resolved recipe.
        resume: continue from the newest checkpoint in ``train.output_dir/checkpoints``.
        nproc: processes to run; default all GPUs on a CUDA machine, dp × cp on a CPU one
            (dp 0 counts as 1). Ignored under torchrun / accelerate launch, which decide.

    Raises:
        UserError: an invalid process layout, no checkpoint to resume from, a model or data
            source that cannot be read, ... (from this process or the first failing rank).
    """
    return launch.dispatch(cfg, run_worker, resume=resume, nproc=nproc)


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What every part of one rank's run is built from.

    Attributes:
        cfg: the recipe, with ``parallel.dp`` resolved.
        pmesh: the dp × cp mesh and this rank's place in it.
        cp: how this rank holds and attends over its part of every sequence.
        accelerator: device, mixed precision, autocast and backward.
    """

    cfg: RecipeConfig
    pmesh: ParallelMesh
    cp: ContextParallel
    accelerator: Accelerator

    @property
    def main(self) -> bool:
        """Whether this is rank 0 (the one that prints and writes shared files)."""
        return self.pmesh.rank == 0


def run_worker(cfg: RecipeConfig, *, resume: bool = False) -> int:
    """Run this rank's part of the training (every rank calls it); returns 0.

    The process group is the caller's when one exists (tests), else made here
    (`lctrain.train.launch.worker_process`).

    Raises:
        UserError: no checkpoint to resume from, a schedule this device cannot run, a model or
            data source that cannot be read, ...
    """
    resume_from = resume_point(Path(cfg.train.output_dir) / "checkpoints", resume)
    with launch.worker_process(cfg) as accelerator:
        device = accelerator.device
        pmesh = build_mesh(cfg.parallel.cp, cfg.parallel.dp or None, device_type=device.type)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=pmesh.dp))
        cp = ContextParallel(pmesh, cfg.parallel.schedule, cfg.parallel.attention_backend,
                             device=device, head_groups=cfg.parallel.head_groups)
        setup = RunSetup(cfg=cfg, pmesh=pmesh, cp=cp, accelerator=accelerator)
        set_seed(cfg.train.seed)
        if setup.main:
            save_resolved(cfg, Path(cfg.train.output_dir) / "config.yaml")
        dataset = build_data(setup)
        setup = dataclasses.replace(setup, cfg=_with_steps(setup, len(dataset)))
        parts = build_model(setup)
        trainer = build_trainer(setup, parts, resume_from)
        train(setup, parts, trainer, dataset, resumed=resume_from is not None)
        cfg = setup.cfg
        if setup.main and cfg.checkpoint.enabled and cfg.checkpoint.export_final:
            export_final(cfg)
    return 0


def build_data(setup: RunSetup) -> PackedRows:
    """The packed rows, prepared once per machine: its local rank 0 tokenizes and packs into the
    data cache (with progress on rank 0) while the other ranks wait, then all memory-map it."""
    tokenizer = load_tokenizer(setup.cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", setup.pmesh.rank))
    rows = prepare_data(setup.cfg.data, tokenizer, leader=local_rank == 0,
                        show_progress=setup.main)
    if setup.main:
        print("\n".join(rows_summary(rows)), flush=True)
    return rows


def _rows_per_step(setup: RunSetup) -> int:
    return setup.pmesh.dp * setup.cfg.train.batch_size * setup.cfg.train.grad_accum


def _with_steps(setup: RunSetup, rows: int) -> RecipeConfig:
    """The recipe with ``train.max_steps`` resolved from train.epochs / train.max_steps and the
    number of packed rows; rank 0 says how the steps relate to epochs."""
    t, per_step = setup.cfg.train, _rows_per_step(setup)
    steps = plan_steps(rows=rows, rows_per_step=per_step, max_steps=t.max_steps, epochs=t.epochs)
    if setup.main:
        print("\n".join(steps_summary(rows=rows, rows_per_step=per_step, steps=steps,
                                       max_steps=t.max_steps, epochs=t.epochs)), flush=True)
    return dataclasses.replace(setup.cfg, train=dataclasses.replace(t, max_steps=steps))


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """The model as the loop trains it.

    Attributes:
        model: the causal LM (inside ``distributed.module``).
        distributed: the `CausalLMLoss` around it, spread over the ranks.
        flops: its FLOP model (for MFU).
        n_params: its parameter count.
        layer_policies: the layers' checkpointing policies of an ``auto`` run (runs text).
    """

    model: nn.Module
    distributed: Distributed
    flops: FlopModel
    n_params: int
    layer_policies: str | None = None


def build_model(setup: RunSetup) -> ModelParts:
    """Model with the schedule's attention, checkpointing policy, then FSDP2 or replication."""
    cfg, accelerator = setup.cfg, setup.accelerator
    model = load_model(cfg.model.path, config=cfg.model.config, seed=cfg.train.seed,
                       dtype=getattr(torch, cfg.model.dtype), device=accelerator.device,
                       attn_implementation=setup.cp.attention,
                       trust_remote_code=cfg.model.trust_remote_code)
    n_params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    flops = FlopModel.for_model(model.config, n_params - (0 if tied else embed.numel()))
    if cfg.lora.enabled:  # LoRA adapters (peft), before checkpointing and FSDP2 wrap the layers
        model = apply_lora(model, cfg.lora, seed=cfg.train.seed)
    setup.cp.check_model(model.config)
    apply_tiling(model, cfg.train.tile_tokens)  # the adapters inside the tiles
    runs = _layer_policies(setup) if cfg.train.checkpointing == "auto" else None
    apply_checkpointing(model, cfg.train.checkpointing,  # before FSDP2 wraps the layers
                        layer_policies=per_layer(runs) if runs else None)
    module = CausalLMLoss(model, cfg.train.loss_chunk_tokens)
    bf16 = accelerator.mixed_precision == "bf16"
    distributed = distribute(module, decoder_layers(model), world_mesh=setup.pmesh.world_mesh,
                             strategy=_strategy(setup), param_dtype=torch.bfloat16 if bf16 else None,
                             offload=cfg.train.state_offload == "all")
    return ModelParts(model, distributed, flops, n_params,
                      format_layer_policies(runs) if runs else None)


def _layer_policies(setup: RunSetup) -> tuple[tuple[str, int], ...]:
    """``auto``'s layer policies: the recipe's, else the memory model's for this device's memory
    and this machine's host memory (`lctrain.memory.recipe.layer_policies_for`)."""
    device, pmesh = setup.accelerator.device, setup.pmesh
    host = setup.cfg.train.host_memory or available_host_bytes()
    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else host or 0)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", pmesh.world_size))
    return layer_policies_for(setup.cfg, gpus=pmesh.world_size, gpu_memory=memory,
                              host_memory=host if device.type == "cuda" else None,
                              gpus_per_node=local)


def _strategy(setup: RunSetup) -> str:
    """FSDP2 when asked ("on") or when the state lives on the host (its CPU offload), or by
    default on GPUs with several ranks; else replication."""
    fsdp, pmesh = setup.cfg.parallel.fsdp, setup.pmesh
    if fsdp == "on" or setup.cfg.train.state_offload == "all" or (
            fsdp == "auto" and pmesh.device_type == "cuda" and pmesh.world_size > 1):
        return "fsdp"
    return "replicate"


def build_trainer(setup: RunSetup, parts: ModelParts, resume_from: Path | None) -> Trainer:
    """Optimizer, schedule and the Trainer; restored from ``resume_from`` when given."""
    t = setup.cfg.train
    optimizer, scheduler = build_optimizer(
        parts.distributed.module, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas),
        warmup_steps=t.warmup_steps, total_steps=t.max_steps, min_lr_ratio=t.min_lr_ratio,
        host_states=t.state_offload == "optimizer")
    trainer = Trainer(distributed=parts.distributed, optimizer=optimizer, scheduler=scheduler,
                      pmesh=setup.pmesh, cp=setup.cp, accelerator=setup.accelerator,
                      grad_accum=t.grad_accum, max_grad_norm=t.max_grad_norm)
    if resume_from is not None:
        state = load_checkpoint(resume_from, module=parts.distributed.module,
                                optimizer=optimizer, scheduler=scheduler,
                                layout=_checkpoint_layout(setup.pmesh))
        trainer.step, trainer.data_position = state["step"], state["data_position"]
    return trainer


def save(setup: RunSetup, trainer: Trainer) -> Path:
    """Checkpoint the trainer's state now (collective: every rank calls it).

    Returns:
        The checkpoint folder.
    """
    cfg = setup.cfg
    return save_checkpoint(Path(cfg.train.output_dir) / "checkpoints", trainer.step,
                           module=trainer.distributed.module, optimizer=trainer.optimizer,
                           scheduler=trainer.scheduler, data_position=trainer.data_position,
                           layout=_checkpoint_layout(setup.pmesh), keep=cfg.checkpoint.keep)


def train(setup: RunSetup, parts: ModelParts, trainer: Trainer, dataset: PackedRows, *,
          resumed: bool) -> None:
    """Announce the run, run the loop with metrics, progress and checkpoints, summarise."""
    cfg, pmesh = setup.cfg, setup.pmesh
    t, out = cfg.train, Path(cfg.train.output_dir)
    if setup.main:
        print(banner(setup, parts, trainer, len(dataset)), flush=True)
        print(record_run(out, trainer.device.type, cfg.parallel.attention_backend), flush=True)
    metrics = MetricsLog(out / "metrics.jsonl", enabled=setup.main,
                         resume_step=trainer.step if resumed else None)
    progress = Progress(t.max_steps, trainer.step, enabled=setup.main,
                        steps_per_epoch=len(dataset) / _rows_per_step(setup))
    hooks = LoopHooks(max_steps=t.max_steps, log_every=t.log_every,
                      checkpoint_every=cfg.checkpoint.every,
                      tokens_per_step=pmesh.dp * t.batch_size * t.grad_accum * cfg.data.seq_len,
                      flops=parts.flops, peak_flops=peak_flops(trainer.device),
                      log=_with_host_memory(metrics.write, trainer), progress=progress.update,
                      save=functools.partial(save, setup, trainer) if cfg.checkpoint.enabled
                      else None)
    batches = iter_batches(dataset, batch_size=t.batch_size, dp_rank=pmesh.dp_rank,
                           dp_size=pmesh.dp, seed=t.seed, start_step=trainer.data_position)
    try:
        history = run_loop(trainer, batches, hooks)
    finally:
        progress.close()
    if setup.main:
        print(_summary(setup, trainer, history), flush=True)


def _with_host_memory(write, trainer: Trainer):
    """On a GPU, log records also carry ``host_memory_bytes``: what this process keeps in host
    memory for training (`lctrain.parallel.offload.host_memory_bytes`)."""
    if trainer.device.type != "cuda":
        return write
    module, optimizer = trainer.distributed.module, trainer.optimizer
    return lambda record: write({**record, "host_memory_bytes": host_memory_bytes(module, optimizer)})


def banner(setup: RunSetup, parts: ModelParts, trainer: Trainer, rows: int) -> str:
    """The line rank 0 prints before the first step: model, data, ranks, steps."""
    cfg, pmesh = setup.cfg, setup.pmesh
    t = cfg.train
    start = f", resuming at step {trainer.step}" if trainer.step else ""
    line = (f"lctrain finetune: {parts.n_params / 1e6:.2f}M parameters, seq_len "
            f"{cfg.data.seq_len}, {rows} packed rows; {pmesh.world_size} x "
            f"{pmesh.device_type} (dp {pmesh.dp} x cp {pmesh.cp}, {cfg.parallel.schedule}, "
            f"{parts.distributed.strategy}); {t.max_steps} steps x "
            f"{pmesh.dp * t.batch_size * t.grad_accum} sequence(s){start}")
    return line + "".join(f"\n  {extra}" for extra in _memory_settings(cfg, parts))


def _memory_settings(cfg: RecipeConfig, parts: ModelParts) -> list[str]:
    """Banner lines for the long-context settings in use, and the plan they came from."""
    t, lines = cfg.train, []
    if parts.layer_policies:
        chosen = "train.layer_policies" if t.layer_policies else "the memory model"
        lines.append(f"checkpointing auto: {parts.layer_policies} (from {chosen})")
    settings = [f"{k} {v}" for k, v in (("tile_tokens", t.tile_tokens),
                                         ("head_groups", cfg.parallel.head_groups),
                                         ("state_offload", t.state_offload))
                if v not in (0, 1, "none")]
    if settings:
        lines.append("memory: " + ", ".join(settings))
    if t.planned:
        lines.append(f"settings from lctrain estimate-memory --plan: {t.planned}")
    return lines


def _summary(setup: RunSetup, trainer: Trainer, history: list[dict]) -> str:
    t, out = setup.cfg.train, setup.cfg.train.output_dir
    if not history:
        return (f"nothing to do: the run is already at step {trainer.step} of {t.max_steps}; "
                "raise train.max_steps (--max-steps) to train further.")
    saved = ("metrics, config and checkpoints" if setup.cfg.checkpoint.enabled
             else "metrics and config")
    first, last = history[0], history[-1]
    return (f"done: step {last['step']}/{t.max_steps}, loss {first['loss']:.4f} -> "
            f"{last['loss']:.4f}; {saved} in {Path(out)}")


def export_final(cfg: RecipeConfig) -> None:
    """Write ``final/`` on rank 0 alone (CPU; the other ranks are done) and say where it is."""
    result = write_final(cfg)
    how = "PeftModel.from_pretrained" if result.kind == "adapter" else "from_pretrained"
    print(f"exported the {result.kind} weights of step {result.step} to {result.output} "
          f"(load with {how})", flush=True)


def _checkpoint_layout(pmesh: ParallelMesh) -> dict:
    """The process layout a checkpoint records and a resumed run must match."""
    return {"dp": pmesh.dp, "cp": pmesh.cp}
