"""What runs: one rank's training from the recipe's parts (the composition root). `finetune`
starts every rank; `run_worker` builds one (mesh, context parallelism, data, model with
``auto`` placed, trainer), runs the loop (`train`) and exports the final model."""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed

from lctrain.checkpoint.reader import load_checkpoint, read_trainer_state, resume_point
from lctrain.checkpoint.writer import Checkpointer
from lctrain.config import RecipeConfig, save_resolved
from lctrain.config.resume import check_run_folder, describe_changes, takes_over
from lctrain.data import (PackedRows, iter_batches, plan_steps, prepare_data, rows_summary,
                          steps_summary)
from lctrain.errors import UserError
from lctrain.launch import launcher, rank
from lctrain.launch.stopping import StopRequest, control_group, stop_exit_code
from lctrain.launch.watchdog import Watchdog, heartbeat_dir
from lctrain.memory.host import available_host_bytes
from lctrain.memory.recipe import placed_layers
from lctrain.model import check_model, load_tokenizer
from lctrain.model.flops import peak_flops
from lctrain.model.structure import decoder_layers
from lctrain.parallel.build import ModelParts, RunSetup
from lctrain.parallel.build import build_model as build_parallel_model
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.loss_sums import validation_loss
from lctrain.parallel.mesh import build_mesh
from lctrain.parallel.offload import host_memory_bytes
from lctrain.report.versions import record_run
from lctrain.train.announce import banner, summary
from lctrain.train.finished_run import export_final, finished, finished_before_launch
from lctrain.train.loop import OPERATIONS, CausalLMLoss, LoopHooks, Trainer, run_loop
from lctrain.train.metrics import Progress
from lctrain.train.nonfinite import Diverged
from lctrain.train.optim import LrPlan, build_optimizer
from lctrain.train.tracking import Tracking, check_report_to


def finetune(cfg: RecipeConfig, *, resume: bool = False, nproc: int | None = None,
             own_process: bool = False) -> int:
    """Fine-tune on ``nproc`` processes (default: all GPUs, or parallel.cp on a CPU), resuming
    the run with ``resume``; returns the exit code (UserError: layout, model, data, ...)."""
    check_report_to(cfg)
    if finished_before_launch(cfg, resume=resume):  # its length set by train.max_steps alone
        return 0
    warnings = check_model(cfg)  # before any process starts or any weight loads
    for warning in warnings if os.environ.get("RANK", "0") == "0" else []:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return launcher.dispatch(cfg, run_worker, resume=resume, nproc=nproc, own_process=own_process)


def run_worker(cfg: RecipeConfig, *, resume: bool = False, stop: StopRequest | None = None) -> int:
    """Run this rank's training; 0, or 128 + the stopping signal (UserError as `finetune`)."""
    out = Path(cfg.train.output_dir)
    takeover = not resume and takes_over(cfg)
    changes = check_run_folder(cfg, resume=resume)
    resume_from = resume_point(out / "checkpoints", resume)
    with stop or StopRequest() as stop, rank.worker_process(cfg) as accelerator:
        stop.request_file = rank.launch_dir(cfg) / "stop"
        device, timeout = accelerator.device, rank.group_timeout(cfg)
        pmesh = build_mesh(cfg.parallel.cp, device_type=device.type, timeout=timeout)
        if pmesh.rank == 0:  # the recipe as given (steps: resolved per launch, below)
            if takeover:
                print(f"lctrain: {out} held a start of another recipe that never completed a "
                      "step; this run takes the folder over", flush=True)
            save_resolved(cfg, out / "config.yaml")
            if changes:
                print(describe_changes(changes), flush=True)
        cp = ContextParallel(pmesh, cfg.parallel.schedule, cfg.parallel.attention_backend,
                             device=device, head_groups=cfg.parallel.head_groups, balance=True)
        setup = RunSetup(cfg=cfg, pmesh=pmesh, cp=cp, accelerator=accelerator, stop=stop,
                         control=control_group(pmesh.world_group, device.type, timeout))
        set_seed(cfg.train.seed)
        dataset = build_data(setup)
        eval_rows = build_data(setup, "eval") if cfg.data.has_eval else None
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


def build_data(setup: RunSetup, part: str = "train") -> PackedRows:
    """The packed rows of ``part``, prepared once per machine (its local rank 0 writes the cache)."""
    local_rank = int(os.environ.get("LOCAL_RANK", setup.pmesh.rank))
    rows = prepare_data(setup.cfg.data, load_tokenizer(setup.cfg), leader=local_rank == 0,
                        show_progress=setup.main, part=part, seed=setup.cfg.train.seed)
    if setup.main:
        print("\n".join(rows_summary(rows)), flush=True)
    return rows


def _with_steps(setup: RunSetup, rows: int) -> RecipeConfig:
    """The recipe with ``train.max_steps`` resolved against the packed rows."""
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
    """The model as training runs it, ``auto`` placed for this machine's memory."""
    device, pmesh, layers = setup.accelerator.device, setup.pmesh, setup.cfg.train.layers
    if layers.auto:
        host = setup.cfg.train.host_memory or available_host_bytes()
        memory = (torch.cuda.get_device_properties(device).total_memory
                  if device.type == "cuda" else host or 0)
        layers = placed_layers(setup.cfg, gpus=pmesh.world_size, gpu_memory=memory,
                               host_memory=host if device.type == "cuda" else None,
                               gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                pmesh.world_size)))
    return build_parallel_model(setup, CausalLMLoss, layers=layers)


def build_trainer(setup: RunSetup, parts: ModelParts, resume_from: Path | None) -> Trainer:
    """Optimizer, schedule and Trainer, restored from ``resume_from`` when given."""
    t = setup.cfg.train
    saved = read_trainer_state(resume_from) if resume_from is not None else None
    if saved is not None:
        check_continuation(saved, setup, resume_from)
    start = saved["step"] if saved is not None else 0
    optimizer, scheduler = build_optimizer(
        parts.distributed.module, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas),
        warmup_steps=t.warmup_steps, total_steps=t.max_steps, min_lr_ratio=t.min_lr_ratio,
        start_step=0 if saved is None else saved_lr_step(saved, resume_from),
        resumed=None if saved is None else saved_plan(saved, resume_from),
        host_states=t.layers.state == "optimizer")
    trainer = Trainer(distributed=parts.distributed, optimizer=optimizer, scheduler=scheduler,
                      pmesh=setup.pmesh, cp=setup.cp, accelerator=setup.accelerator,
                      grad_accum=t.grad_accum, max_grad_norm=t.max_grad_norm)
    if saved is not None:
        load_checkpoint(resume_from, module=parts.distributed.module, optimizer=optimizer)
        trainer.step = start
        trainer.data_position = saved["rows_consumed"] // (setup.pmesh.dp * t.batch_size)
        streak = saved.get("nonfinite_run", 0)  # skipped steps in a row up to the checkpoint
        if not isinstance(streak, int) or not 0 <= streak <= start:
            raise UserError(f"{resume_from / 'trainer.json'} holds no valid nonfinite_run "
                            f"({streak!r}); the checkpoint is damaged.")
        trainer.nonfinite.run = torch.full((), float(streak), device=trainer.device)
    return trainer


def train(setup: RunSetup, parts: ModelParts, trainer: Trainer, dataset: PackedRows, *,
          resumed: bool, eval_rows: PackedRows | None = None) -> int:
    """Announce, run the loop and summarise; returns the signal that stopped the run (0: none)."""
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
                           dp_size=pmesh.dp, seed=t.seed, start_step=trainer.data_position,
                           grad_accum=t.grad_accum)
    try:
        with watch:
            history = run_loop(trainer, batches, hooks)
            watch.idle()
    except Diverged as exc:  # every rank stops here: the save in flight lands, then the hint
        if checkpointer is not None:
            checkpointer.close()
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
    """What the loop does around the steps (log, validate, save, stop, mark)."""
    cfg, pmesh, t = setup.cfg, setup.pmesh, setup.cfg.train
    evaluate = None if eval_rows is None else functools.partial(
        validation_loss, trainer.distributed.module, eval_rows, cp=setup.cp, pmesh=pmesh,
        accelerator=setup.accelerator, batch_size=t.batch_size)
    trainer.mark = mark = lambda operation, step: watch.enter(OPERATIONS[operation], step)
    watch.watch_layers(decoder_layers(parts.model))  # the timeout bounds a layer, not a step
    say = setup.main  # rank 0 says which steps were skipped (on stdout, with the progress)
    return LoopHooks(max_steps=t.max_steps, checkpoint_every=cfg.checkpoint.every,
                     tokens_per_step=pmesh.dp * t.batch_size * t.grad_accum * cfg.data.seq_len,
                     flops=parts.flops, peak_flops=peak_flops(trainer.device), log=log,
                     progress=progress,
                     save=functools.partial(save, setup, trainer, checkpointer)
                     if checkpointer is not None else None,
                     stop=functools.partial(setup.stop.agree, setup.control),
                     max_nonfinite_steps=t.max_nonfinite_steps, mark=mark,
                     notice=lambda text: print(f"lctrain: {text}", flush=True) if say else None,
                     completed=watch.completed, evaluate=evaluate, eval_every=t.eval_every)


def _with_host_memory(write, trainer: Trainer):
    """On a GPU, log records also carry ``host_memory_bytes`` (the most held for training)."""
    if trainer.device.type != "cuda":
        return write
    module, optimizer = trainer.distributed.module, trainer.optimizer
    trainer.host_probe = lambda: host_memory_bytes(module, optimizer)
    return lambda record: write({**record, "host_memory_bytes": max(trainer.host_peak,
                                                                    trainer.host_probe())})


def check_continuation(saved: dict, setup: RunSetup, path: Path) -> None:
    """Refuse (UserError) a checkpoint of another sequence length or global batch."""
    cfg, dp, t = setup.cfg, setup.pmesh.dp, setup.cfg.train
    if saved["seq_len"] != cfg.data.seq_len:
        raise UserError(f"the checkpoint {path} was trained at data.seq_len {saved['seq_len']} "
                        f"but this run has {cfg.data.seq_len}; resume with the run's seq_len.")
    rows = setup.rows_per_step
    if saved["rows_per_step"] != rows:
        keep = saved["rows_per_step"] / (dp * t.batch_size)
        fix = (f"set train.grad_accum={int(keep)} to keep it" if keep == int(keep) else
               "choose train.batch_size and train.grad_accum so that dp × batch_size × "
               "grad_accum equals it")
        raise UserError(f"the checkpoint {path} took {saved['rows_per_step']} rows per step but "
                        f"this run takes {rows} (dp {dp} × batch_size {t.batch_size} × "
                        f"grad_accum {t.grad_accum}); {fix}.")


def saved_plan(saved: dict, path: Path) -> LrPlan:
    try:
        return LrPlan.from_json(saved["lr_plan"])
    except ValueError as error:
        raise UserError(f"{path / 'trainer.json'} holds no valid learning-rate plan "
                        f"({error}); the checkpoint is damaged.") from None


def saved_lr_step(saved: dict, path: Path) -> int:
    """Where the checkpoint's learning-rate schedule stands: its step less the skipped steps,
    for which the schedule was wound back (the step itself in a checkpoint without ``lr_step``)."""
    lr_step = saved.get("lr_step", saved["step"])
    if not isinstance(lr_step, int) or not 0 <= lr_step <= saved["step"]:
        raise UserError(f"{path / 'trainer.json'} holds no valid lr_step ({lr_step!r}); the "
                        "checkpoint is damaged.")
    return lr_step


def trainer_state(setup: RunSetup, trainer: Trainer) -> dict:
    """A checkpoint's trainer.json: step, data position, global batch, layout, rate plan and
    the schedule's position in it, whether the step trained (its update was not skipped) and
    how many skipped steps in a row led up to it."""
    pmesh, seq_len = setup.pmesh, setup.cfg.data.seq_len
    rows = trainer.data_position * pmesh.dp * setup.cfg.train.batch_size
    return {"step": trainer.step, "rows_consumed": rows, "tokens_consumed": rows * seq_len,
            "seq_len": seq_len, "rows_per_step": setup.rows_per_step,
            "layout": {"dp": pmesh.dp, "cp": pmesh.cp, "world_size": pmesh.world_size},
            "lr_plan": trainer.scheduler.lr_lambdas[0].to_json(),
            "lr_step": trainer.scheduler.last_epoch,  # behind step by the skipped steps
            "nonfinite_run": int(trainer.nonfinite.run.item()),  # the streak a resume goes on
            "trained": trainer.step_trained}


def save(setup: RunSetup, trainer: Trainer, checkpointer: Checkpointer) -> Path:
    """Checkpoint the trainer's state now (collective; UserError: a weight is not finite)."""
    if not trainer.weights_finite():
        raise UserError(f"the model's weights are not finite after step {trainer.step}, so no "
                        f"checkpoint was saved and none was deleted; "
                        f"{launcher.checkpoint_hint(setup.cfg, setup.pmesh.world_size)}.")
    return checkpointer.save(trainer.step, trainer_state(setup, trainer))


def make_checkpointer(setup: RunSetup, trainer: Trainer) -> Checkpointer | None:
    """The run's checkpointer (in the background on GPUs), or None when checkpoint.keep is 0."""
    ckpt = setup.cfg.checkpoint
    if not ckpt.enabled:
        return None
    return Checkpointer(Path(setup.cfg.train.output_dir) / "checkpoints",
                        module=trainer.distributed.module, optimizer=trainer.optimizer,
                        keep=ckpt.keep, asynchronous=trainer.device.type == "cuda",
                        local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
