"""What runs: one rank's training, from the recipe's parts to the loop (the composition root).

    finetune(cfg, resume=False, nproc=None)   # start every rank (lctrain.launch.launcher.dispatch)
    run_worker(cfg, resume=False)             # what each rank runs

`run_worker` builds one rank's run in this order; each step is a function of this module that a
feature extends in one place:

    rank.worker_process        accelerate's Accelerator: process group, device, mixed precision
    → dp × cp mesh → seed → ContextParallel (how sequences are cut, which attention runs)
    → build_data               tokenize and pack once per machine into the data cache
                               (its local rank 0 prepares, the others wait and memory-map it);
                               train.epochs / train.max_steps resolved against its rows
    → build_eval_data          the validation rows (data.eval_source / data.eval_fraction),
                               prepared the same way; None without validation data
    → finished                 on --resume, a run that has trained all its steps stops here
                               (before any weight loads) and says where its final model is;
                               `finetune` checks this before any process starts when
                               train.max_steps alone sets the length (`finished_run`)
    → build_model              the model with the schedule's attention → LoRA adapters when
                               the recipe asks → checkpointing policy
                               → FSDP2 or replication (`ModelParts`)
    → build_trainer            AdamW + warm-up/cosine; restored from a checkpoint on --resume
    → train                    banner, versions (environment.json), `LoopHooks` (metrics.jsonl
                               and TensorBoard, progress, validation, `save`, the stop check, the
                               watchdog's marks), the loop inside the hang watchdog, the summary
    → export_final             rank 0 writes output_dir/final/ as a Hugging Face folder
                               (`finished_run`)

Around all of it, a stop signal (SIGTERM, SIGINT, SIGHUP) only sets a flag (`StopRequest`);
the ranks agree on it at each step boundary, save when ``checkpoint.on_signal`` asks, rank 0
says where the last checkpoint is and how to resume, and every rank returns 128 + the signal.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed

from lctrain.config import RecipeConfig, save_resolved
from lctrain.config.resume import check_run_folder, describe_changes
from lctrain.config.tiers import format_layer_policies, per_layer
from lctrain.data import PackedRows, iter_batches, plan_steps, prepare_data, rows_summary, steps_summary
from lctrain.model import load_tokenizer
from lctrain.errors import UserError
from lctrain.parallel.forward import validation_loss
from lctrain.memory.host import available_host_bytes
from lctrain.memory.recipe import layer_policies_for
from lctrain.model.structure import decoder_layers
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.mesh import build_mesh
from lctrain.parallel.offload import host_memory_bytes
from lctrain.report.versions import record_run
from lctrain.launch import launcher, rank
from lctrain.train.announce import banner, summary
from lctrain.checkpoint.reader import load_checkpoint, read_trainer_state, resume_point
from lctrain.checkpoint.writer import Checkpointer
from lctrain.train.finished_run import export_final, finished, finished_before_launch
from lctrain.launch.launcher import default_nproc
from lctrain.train.loop import OPERATIONS, CausalLMLoss, LoopHooks, Trainer, run_loop
from lctrain.model import check_model
from lctrain.model.flops import peak_flops
from lctrain.train.metrics import Progress
from lctrain.train.nonfinite import Diverged
from lctrain.train.optim import build_optimizer
from lctrain.train.saving import check_continuation, make_checkpointer, save, saved_plan
from lctrain.parallel.build import ModelParts, RunSetup
from lctrain.parallel.build import build_model as build_parallel_model
from lctrain.launch.stopping import StopRequest, control_group, stop_exit_code
from lctrain.train.tracking import Tracking, check_report_to
from lctrain.launch.watchdog import Watchdog, heartbeat_dir

__all__ = ["ModelParts", "RunSetup", "build_data", "build_eval_data", "build_model",
           "build_trainer", "default_nproc", "export_final", "finetune", "finished", "loop_hooks",
           "run_worker", "train"]


def finetune(cfg: RecipeConfig, *, resume: bool = False, nproc: int | None = None,
             own_process: bool = False) -> int:
    """Fine-tune as the recipe says; returns the process exit code (0 on success).

    Args:
        cfg: the resolved recipe.
        resume: continue from the newest checkpoint in ``train.output_dir/checkpoints``
            (a run that has trained all its steps is not trained again: `finished`).
        nproc: processes to run; default all GPUs on a CUDA machine, dp × cp on a CPU one
            (dp 0 counts as 1). Ignored under torchrun / accelerate launch, which decide.
        own_process: run even a single rank in a process of its own (`launcher.dispatch`).

    Raises:
        UserError: an invalid process layout, no checkpoint to resume from, a model or data
            source that cannot be read, ... (from this process or the first failing rank).
    """
    check_report_to(cfg)
    if finished_before_launch(cfg, resume=resume):  # its length set by train.max_steps alone
        return 0
    warnings = check_model(cfg)  # before any process starts or any weight loads
    for warning in warnings if os.environ.get("RANK", "0") == "0" else []:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return launcher.dispatch(cfg, run_worker, resume=resume, nproc=nproc, own_process=own_process)


def run_worker(cfg: RecipeConfig, *, resume: bool = False, stop: StopRequest | None = None) -> int:
    """Run this rank's part of the training (every rank calls it).

    The process group is the caller's when one exists (tests), else made here
    (`lctrain.launch.rank.worker_process`). ``stop`` is the process's stop-signal flag when the
    caller installed it already (a self-launched rank does, first thing), else one is installed
    for the call.

    Returns:
        0, or 128 + the signal when a stop signal ended the run early.

    Raises:
        UserError: no checkpoint to resume from, a schedule this device cannot run, a model or
            data source that cannot be read, a run whose loss stayed non-finite, ...
    """
    out = Path(cfg.train.output_dir)
    changes = check_run_folder(cfg, resume=resume)
    resume_from = resume_point(out / "checkpoints", resume)
    with stop or StopRequest() as stop, rank.worker_process(cfg) as accelerator:
        stop.request_file = rank.launch_dir(cfg) / "stop"
        device, timeout = accelerator.device, rank.group_timeout(cfg)
        pmesh = build_mesh(cfg.parallel.cp, cfg.parallel.dp or None, device_type=device.type,
                           timeout=timeout)
        if pmesh.rank == 0:  # the recipe as given (dp, steps: resolved per launch, below)
            save_resolved(cfg, out / "config.yaml")
            if changes:
                print(describe_changes(changes), flush=True)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=pmesh.dp))
        cp = ContextParallel(pmesh, cfg.parallel.schedule, cfg.parallel.attention_backend,
                             device=device, head_groups=cfg.parallel.head_groups,
                             balance=cfg.parallel.balance_documents)
        setup = RunSetup(cfg=cfg, pmesh=pmesh, cp=cp, accelerator=accelerator, stop=stop,
                         control=control_group(pmesh.world_group, device.type, timeout))
        set_seed(cfg.train.seed)
        dataset = build_data(setup)
        eval_rows = build_eval_data(setup)
        setup = dataclasses.replace(setup, cfg=_with_steps(setup, len(dataset)))
        if resume and finished(setup.cfg, setup.cfg.train.max_steps, main=setup.main):
            return 0  # (a run by train.epochs: its length is known from the data only)
        parts = build_model(setup)
        trainer = build_trainer(setup, parts, resume_from)
        signum = train(setup, parts, trainer, dataset, resumed=resume_from is not None,
                       eval_rows=eval_rows)
        if signum:
            stop.ignore()  # the run is over: a late signal (e.g. torchrun's) must not cut the exit
            pmesh.barrier()
            return stop_exit_code(signum)
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


def build_eval_data(setup: RunSetup) -> PackedRows | None:
    """The validation rows (data.eval_source, or the documents data.eval_fraction holds out),
    prepared as `build_data` prepares the training rows; None without validation data."""
    if not setup.cfg.data.has_eval:
        return None
    tokenizer = load_tokenizer(setup.cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", setup.pmesh.rank))
    rows = prepare_data(setup.cfg.data, tokenizer, leader=local_rank == 0,
                        show_progress=setup.main, part="eval")
    if setup.main:
        print("\n".join(rows_summary(rows)), flush=True)
    return rows


def _with_steps(setup: RunSetup, rows: int) -> RecipeConfig:
    """The recipe with ``train.max_steps`` resolved from train.epochs / train.max_steps and the
    number of packed rows; rank 0 says how the steps relate to epochs."""
    t, per_step = setup.cfg.train, setup.rows_per_step
    steps = plan_steps(rows=rows, rows_per_step=per_step, max_steps=t.max_steps, epochs=t.epochs)
    if setup.main:
        print("\n".join(steps_summary(rows=rows, rows_per_step=per_step, steps=steps,
                                       max_steps=t.max_steps, epochs=t.epochs)), flush=True)
        if t.warmup_steps > steps:
            print(f"warning: train.warmup_steps {t.warmup_steps} is longer than the run ({steps} "
                  "steps): the learning rate never reaches train.lr", flush=True)
    return dataclasses.replace(setup.cfg, train=dataclasses.replace(t, max_steps=steps))


def build_model(setup: RunSetup) -> ModelParts:
    """The model as training runs it (`lctrain.parallel.build.build_model`) under the summed
    loss (`CausalLMLoss`), its layers checkpointed as the recipe or the memory model says."""
    runs = _layer_policies(setup) if setup.cfg.train.checkpointing == "auto" else None
    return build_parallel_model(setup, CausalLMLoss, layer_runs=runs)


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


def build_trainer(setup: RunSetup, parts: ModelParts, resume_from: Path | None) -> Trainer:
    """Optimizer, schedule and the Trainer; restored from ``resume_from`` when given (into this
    run's sharding and layout, the learning-rate plan re-planned to this run's length).

    Raises:
        UserError: the checkpoint cannot continue in this run (another global batch or
            sequence length, another model, a damaged checkpoint).
    """
    t = setup.cfg.train
    saved = read_trainer_state(resume_from) if resume_from is not None else None
    if saved is not None:
        check_continuation(saved, setup, resume_from)
    start = saved["step"] if saved is not None else 0
    optimizer, scheduler = build_optimizer(
        parts.distributed.module, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas),
        warmup_steps=t.warmup_steps, total_steps=t.max_steps, min_lr_ratio=t.min_lr_ratio,
        start_step=start, resumed=None if saved is None else saved_plan(saved, resume_from),
        host_states=t.state_offload == "optimizer")
    trainer = Trainer(distributed=parts.distributed, optimizer=optimizer, scheduler=scheduler,
                      pmesh=setup.pmesh, cp=setup.cp, accelerator=setup.accelerator,
                      grad_accum=t.grad_accum, max_grad_norm=t.max_grad_norm)
    if saved is not None:
        load_checkpoint(resume_from, module=parts.distributed.module, optimizer=optimizer)
        trainer.step = start
        trainer.data_position = saved["rows_consumed"] // (setup.pmesh.dp * t.batch_size)
    return trainer


def train(setup: RunSetup, parts: ModelParts, trainer: Trainer, dataset: PackedRows, *,
          resumed: bool, eval_rows: PackedRows | None = None) -> int:
    """Announce the run, run the loop with metrics, progress, validation on ``eval_rows``,
    checkpoints and the hang watchdog, summarise.

    Returns:
        The signal that stopped the run early (0: it ran to the end).

    Raises:
        UserError: ``train.max_nonfinite_steps`` steps in a row were not finite.
    """
    cfg, pmesh = setup.cfg, setup.pmesh
    t, out = cfg.train, Path(cfg.train.output_dir)
    if setup.main:
        print(banner(setup, parts, trainer, len(dataset)), flush=True)
        print(record_run(out, trainer.device.type, cfg.parallel.attention_backend,
                         cfg.data.document_mask), flush=True)
    checkpointer = make_checkpointer(setup, trainer)
    metrics = Tracking(cfg, enabled=setup.main, resume_step=trainer.step if resumed else None)
    progress = Progress(t.max_steps, trainer.step, enabled=setup.main,
                        steps_per_epoch=len(dataset) / setup.rows_per_step)
    watch = Watchdog(heartbeat_dir(out), rank=pmesh.rank, world_size=pmesh.world_size,
                     timeout=t.collective_timeout,
                     on_hang=rank.hang_handler(cfg, trainer.device.type))
    hooks = loop_hooks(setup, parts, trainer, watch, checkpointer,
                       log=_with_host_memory(metrics.write, trainer), progress=progress.update,
                       eval_rows=eval_rows)
    batches = iter_batches(dataset, batch_size=t.batch_size, dp_rank=pmesh.dp_rank,
                           dp_size=pmesh.dp, seed=t.seed, start_step=trainer.data_position)
    try:
        with watch:
            history = run_loop(trainer, batches, hooks)
            watch.idle()
    except Diverged as exc:
        raise UserError(f"{exc}: their updates were skipped and the run stopped (a learning rate "
                        f"too high for this model, train.lr, is the usual cause); "
                        f"{launcher.checkpoint_hint(cfg, pmesh.world_size)}.") from None
    finally:
        progress.close()
        metrics.close()
    if checkpointer is not None:
        checkpointer.close()  # the last save is published before the run ends
    if setup.main:
        print(summary(setup, trainer, history, hooks.stopped_by), flush=True)
    return hooks.stopped_by


def loop_hooks(setup: RunSetup, parts: ModelParts, trainer: Trainer, watch: Watchdog,
               checkpointer: Checkpointer | None, *, log, progress,
               eval_rows: PackedRows | None = None) -> LoopHooks:
    """What the loop does around the steps: ``log`` each record, show ``progress``, validate
    on ``eval_rows``, save checkpoints, agree on stop signals, mark for ``watch`` (the
    trainer's marks too)."""
    cfg, pmesh, t = setup.cfg, setup.pmesh, setup.cfg.train
    evaluate = None if eval_rows is None else functools.partial(
        validation_loss, trainer.distributed.module, eval_rows, cp=setup.cp, pmesh=pmesh,
        accelerator=setup.accelerator, batch_size=t.batch_size)
    trainer.mark = mark = functools.partial(_mark, watch)
    watch.watch_layers(decoder_layers(parts.model))  # the timeout bounds a layer, not a step
    return LoopHooks(max_steps=t.max_steps, log_every=t.log_every,
                     checkpoint_every=cfg.checkpoint.every,
                     tokens_per_step=pmesh.dp * t.batch_size * t.grad_accum * cfg.data.seq_len,
                     flops=parts.flops, peak_flops=peak_flops(trainer.device), log=log,
                     progress=progress,
                     save=functools.partial(save, setup, trainer, checkpointer)
                     if checkpointer is not None else None,
                     stop=functools.partial(setup.stop.agree, setup.control),
                     save_on_stop=cfg.checkpoint.on_signal,
                     max_nonfinite_steps=t.max_nonfinite_steps, notice=_notice(setup),
                     mark=mark, completed=watch.completed, evaluate=evaluate,
                     eval_every=t.eval_every)


def _mark(watch: Watchdog, operation: str, step: int) -> None:
    watch.enter(OPERATIONS[operation], step)


def _notice(setup: RunSetup):
    """What rank 0 says about skipped steps (on stdout, with the progress: a self-launched
    rank's stderr goes to the workers' log); the others stay quiet."""
    def notice(text: str) -> None:
        if setup.main:
            print(f"lctrain: {text}", flush=True)
    return notice


def _with_host_memory(write, trainer: Trainer):
    """On a GPU, log records also carry ``host_memory_bytes``: the most this process has kept in
    host memory for training (`lctrain.parallel.offload.host_memory_bytes`), read at each log
    and at the end of each step's update, before the gradients (held on the host under
    ``train.state_offload: all``) are dropped."""
    if trainer.device.type != "cuda":
        return write
    module, optimizer = trainer.distributed.module, trainer.optimizer
    trainer.host_probe = lambda: host_memory_bytes(module, optimizer)
    return lambda record: write({**record, "host_memory_bytes": max(trainer.host_peak,
                                                                    trainer.host_probe())})
