"""The one composition root of training: `finetune(cfg)` wires every part of lctrain together.

`finetune` decides WHERE the work runs — in this process (one process, or already under
torchrun / accelerate launch) or in ``nproc`` processes it starts itself through
torch.distributed.run (`lctrain.train.launch`) — and `run_worker` builds one rank's run:

    accelerate Accelerator (process group: gloo on CPU, NCCL on GPUs; device; autocast)
    → seed → dp × cp mesh → packed data → model with the "lctrain" attention
    → checkpointing policy → FSDP2 or replication → AdamW + warm-up/cosine
    → resume from the newest checkpoint (--resume) → the loop, logs and checkpoints.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from lctrain.config import RecipeConfig, save_resolved
from lctrain.errors import UserError
from lctrain.parallel.mesh import ParallelMesh, build_mesh, check_parallel_sizes

_LAUNCHER_ENV = ("RANK", "LOCAL_RANK")


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
    from lctrain.model import check_model

    warnings = check_model(cfg)  # before any process starts or any weight loads
    for warning in warnings if os.environ.get("RANK", "0") == "0" else []:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if any(name in os.environ for name in _LAUNCHER_ENV):
        return run_worker(cfg, resume=resume)
    n = nproc if nproc is not None else default_nproc(cfg)
    check_parallel_sizes(n, cfg.parallel.cp, cfg.parallel.dp or None)
    _check_schedule(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    check_host_memory(cfg, local_processes=n, gpus=n)
    if n == 1:
        return run_worker(cfg, resume=resume)
    from lctrain.train.launch import spawn_workers

    _check_output_dir(cfg, resume)  # fail before starting any process

    return spawn_workers(cfg, nproc=n, resume=resume)


def default_nproc(cfg: RecipeConfig) -> int:
    """All local GPUs on a CUDA machine; dp × cp processes on a CPU-only one."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(cfg.parallel.dp, 1) * cfg.parallel.cp


def run_worker(cfg: RecipeConfig, *, resume: bool = False) -> int:
    """Run this rank's part of the training (every rank calls it); returns 0.

    The process group is the caller's when one exists (tests); otherwise accelerate makes it
    from torchrun's environment (gloo on CPU, NCCL on GPUs), or — a lone process — a one-rank
    group is made, so that every code path (mesh, counts, DCP checkpoints) is the same. A group
    made here is destroyed at the end.
    """
    from accelerate import Accelerator

    resume_from = _check_output_dir(cfg, resume)
    cuda = torch.cuda.is_available()
    precision = _precision(cfg, cuda)
    own_group = not dist.is_initialized()
    accelerator = Accelerator(cpu=not cuda, mixed_precision=precision)
    store_dir = _ensure_process_group(accelerator.device)
    try:
        _check_schedule(cfg, accelerator.device.type)
        if "LOCAL_WORLD_SIZE" in os.environ:  # started by torchrun / accelerate launch
            check_host_memory(cfg, local_processes=int(os.environ["LOCAL_WORLD_SIZE"]),
                              gpus=dist.get_world_size())
        pmesh = build_mesh(cfg.parallel.cp, cfg.parallel.dp or None,
                           device_type=accelerator.device.type)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=pmesh.dp))
        _train(cfg, pmesh, accelerator, precision, resume_from)
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)
    return 0


def _check_schedule(cfg: RecipeConfig, device_type: str) -> None:
    """Raise a UserError if the attention schedule cannot run on this device type."""
    if cfg.parallel.schedule == "context_parallel" and cfg.parallel.cp > 1:
        from lctrain.parallel.torch_cp import check_available

        check_available(device_type)


def check_host_memory(cfg: RecipeConfig, *, local_processes: int, gpus: int,
                      available: int | None = None) -> None:
    """Fail before training if remat-offload would pin more host memory than this machine has.

    Every GPU process parks ``host_offload`` bytes (the memory model's figure) in page-locked
    host memory; running out of it gets the processes killed by the kernel mid-step, with no
    message. Checked on CUDA machines only (on a CPU offload pins nothing).

    Args:
        cfg: the recipe.
        local_processes: training processes on this machine.
        gpus: GPUs in the whole job.
        available: host bytes available (default: ``train.host_memory``, else MemAvailable
            of /proc/meminfo; no check where that cannot be read).

    Raises:
        UserError: the parked activations of this machine's processes exceed the share of the
            available host memory that may be pinned (`lctrain.memory.HOST_USABLE`).
    """
    if cfg.train.checkpointing != "remat-offload" or not torch.cuda.is_available():
        return
    if available is None:
        available = cfg.train.host_memory or _available_host_bytes()
    if not available:
        return
    from lctrain.memory import estimate_recipe, host_offload_fits

    try:
        est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=gpus, gpu_memory=1 << 40)
    except UserError:
        return  # no readable architecture here: loading the model reports it
    need = est.details["host_offload"] * local_processes
    if not host_offload_fits(est.details["host_offload"], local_processes, available):
        gib = 1 << 30
        raise UserError(
            f"remat-offload at data.seq_len {cfg.data.seq_len} parks about "
            f"{est.details['host_offload'] / gib:.0f} GiB of activations per GPU in pinned host "
            f"memory, {need / gib:.0f} GiB for the {local_processes} processes on this machine, "
            f"but only {available / gib:.0f} GiB is available; lower data.seq_len, raise "
            f"parallel.cp over more machines, or use train.checkpointing=remat (or, where the "
            f"machine has more than it reports, say how much with train.host_memory).")


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _check_output_dir(cfg: RecipeConfig, resume: bool) -> Path | None:
    """The checkpoint to resume from (None for a fresh run).

    Raises:
        UserError: --resume without a checkpoint, or a fresh run into a folder that has some.
    """
    from lctrain.train.checkpoint import find_resume_checkpoint, list_checkpoints

    out = Path(cfg.train.output_dir)
    if resume:
        return find_resume_checkpoint(out / "checkpoints")
    if list_checkpoints(out / "checkpoints"):
        raise UserError(f"{out} already holds checkpoints of an earlier run; pass --resume to "
                        "continue it, or choose another train.output_dir (or delete that one).")
    return None


def _train(cfg: RecipeConfig, pmesh: ParallelMesh, accelerator, precision: str,
           resume_from: Path | None) -> None:
    from accelerate.utils import set_seed

    set_seed(cfg.train.seed)
    if pmesh.rank == 0:
        save_resolved(cfg, Path(cfg.train.output_dir) / "config.yaml")
    dataset = _build_data(cfg, pmesh)
    parts = _build_model(cfg, pmesh, accelerator.device, precision)
    trainer = _build_trainer(cfg, pmesh, parts, accelerator, resume_from)
    _run(cfg, pmesh, parts, trainer, dataset, resume_from is not None)


def _precision(cfg: RecipeConfig, cuda: bool) -> str:
    """Accelerate's mixed_precision: "bf16" or "no" ("auto" = bf16 on GPUs that have it)."""
    wanted = cfg.train.mixed_precision
    if wanted == "auto":
        return "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"
    return wanted


def _ensure_process_group(device: torch.device) -> str | None:
    """Make a one-rank group when none exists (a lone process, not under a launcher).

    Returns:
        The temporary folder of its file store (to delete at the end), or None.
    """
    if dist.is_initialized():
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    store_dir = tempfile.mkdtemp(prefix="lctrain-pg-")
    dist.init_process_group(backend, init_method=f"file://{os.path.join(store_dir, 'store')}",
                            rank=0, world_size=1)
    return store_dir


def _build_data(cfg: RecipeConfig, pmesh: ParallelMesh):
    """Tokenize and pack the data; rank 0 first, so a datasets cache is written once."""
    from lctrain.data import build_packed_dataset, load_tokenizer

    if pmesh.rank != 0:
        _barrier()
    tokenizer = load_tokenizer(cfg)
    dataset = build_packed_dataset(cfg, tokenizer)
    if pmesh.rank == 0:
        _barrier()
    return dataset


@dataclasses.dataclass
class _ModelParts:
    model: torch.nn.Module
    distributed: object  # lctrain.parallel.fsdp.Distributed
    flops: object  # lctrain.train.metrics.FlopModel
    n_params: int


def _build_model(cfg: RecipeConfig, pmesh: ParallelMesh, device: torch.device,
                 precision: str) -> _ModelParts:
    """Model with the lctrain attention, checkpointing policy, then FSDP2 or replication."""
    from lctrain.model import load_model
    from lctrain.model.structure import decoder_layers
    from lctrain.parallel.checkpointing import apply_checkpointing
    from lctrain.parallel.fsdp import distribute
    from lctrain.train.loop import CausalLMLoss
    from lctrain.train.metrics import FlopModel

    model = load_model(cfg.model.path, config=cfg.model.config, seed=cfg.train.seed,
                       dtype=getattr(torch, cfg.model.dtype), device=device,
                       trust_remote_code=cfg.model.trust_remote_code,
                       seq_len=cfg.data.seq_len, cp=cfg.parallel.cp)
    n_params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    flops = FlopModel.for_model(model.config, n_params - (0 if tied else embed.numel()))
    apply_checkpointing(model, cfg.train.checkpointing)  # before FSDP2 wraps the layers
    strategy = _strategy(cfg, pmesh)
    module = CausalLMLoss(model, cfg.train.loss_chunk_tokens)
    distributed = distribute(module, decoder_layers(model), world_mesh=pmesh.world_mesh,
                             strategy=strategy,
                             param_dtype=torch.bfloat16 if precision == "bf16" else None)
    return _ModelParts(model, distributed, flops, n_params)


def _strategy(cfg: RecipeConfig, pmesh: ParallelMesh) -> str:
    """FSDP2 when asked ("on"), or by default on GPUs with several ranks; else replication."""
    if cfg.parallel.fsdp == "on":
        return "fsdp"
    if cfg.parallel.fsdp == "auto" and pmesh.device_type == "cuda" and pmesh.world_size > 1:
        return "fsdp"
    return "replicate"


def _build_trainer(cfg: RecipeConfig, pmesh: ParallelMesh, parts: _ModelParts, accelerator,
                   resume_from: Path | None):
    """Optimizer, schedule and the Trainer; restored from ``resume_from`` when given."""
    from lctrain.train.checkpoint import load_checkpoint
    from lctrain.train.loop import Trainer
    from lctrain.train.optim import build_optimizer

    t = cfg.train
    optimizer, scheduler = build_optimizer(
        parts.distributed.module, lr=t.lr, weight_decay=t.weight_decay, betas=tuple(t.betas),
        warmup_steps=t.warmup_steps, total_steps=t.max_steps, min_lr_ratio=t.min_lr_ratio)
    trainer = Trainer(distributed=parts.distributed, optimizer=optimizer, scheduler=scheduler,
                      pmesh=pmesh, device=accelerator.device,
                      layout=cfg.parallel.layout,
                      schedule=cfg.parallel.schedule, backend=cfg.parallel.attention_backend,
                      grad_accum=t.grad_accum, max_grad_norm=t.max_grad_norm,
                      autocast=accelerator.autocast,
                      torch_cp=_torch_cp(cfg, pmesh, accelerator.device))
    if resume_from is not None:
        state = load_checkpoint(resume_from, module=parts.distributed.module,
                                optimizer=optimizer, scheduler=scheduler, layout=_layout(pmesh))
        trainer.step, trainer.data_position = state["step"], state["data_position"]
    return trainer


def _torch_cp(cfg: RecipeConfig, pmesh: ParallelMesh, device: torch.device):
    """torch's context parallelism for the context_parallel peer schedule, else None."""
    if cfg.parallel.schedule != "context_parallel" or pmesh.cp == 1:
        return None
    from lctrain.parallel.torch_cp import TorchContextParallel

    return TorchContextParallel(pmesh.mesh["cp"], pmesh.cp_rank, device)


def _run(cfg: RecipeConfig, pmesh: ParallelMesh, parts: _ModelParts, trainer, dataset,
         resumed: bool) -> None:
    """Announce the run, run the loop with metrics, progress and checkpoints, summarise."""
    from lctrain.data import iter_batches
    from lctrain.train.checkpoint import save_checkpoint
    from lctrain.train.loop import LoopHooks, run_loop
    from lctrain.train.metrics import MetricsLog, Progress, peak_flops

    t, out, main = cfg.train, Path(cfg.train.output_dir), pmesh.rank == 0
    if main:
        print(_banner(cfg, pmesh, parts, trainer, len(dataset)), flush=True)
    metrics = MetricsLog(out / "metrics.jsonl", enabled=main,
                         resume_step=trainer.step if resumed else None)
    progress = Progress(t.max_steps, trainer.step, enabled=main)

    def save() -> Path:
        return save_checkpoint(out / "checkpoints", trainer.step, module=trainer.distributed.module,
                               optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                               data_position=trainer.data_position, layout=_layout(pmesh),
                               keep=cfg.checkpoint.keep)

    hooks = LoopHooks(max_steps=t.max_steps, log_every=t.log_every,
                      checkpoint_every=cfg.checkpoint.every,
                      tokens_per_step=pmesh.dp * t.batch_size * t.grad_accum * cfg.data.seq_len,
                      flops=parts.flops, peak_flops=peak_flops(trainer.device),
                      log=metrics.write, progress=progress.update,
                      save=save if cfg.checkpoint.enabled else None)
    batches = iter_batches(dataset, batch_size=t.batch_size, dp_rank=pmesh.dp_rank,
                           dp_size=pmesh.dp, seed=t.seed, start_step=trainer.data_position)
    try:
        history = run_loop(trainer, batches, hooks)
    finally:
        progress.close()
    saved = "metrics, config and checkpoints" if cfg.checkpoint.enabled else "metrics and config"
    if main and history:
        first, last = history[0], history[-1]
        print(f"done: step {last['step']}/{t.max_steps}, loss {first['loss']:.4f} -> "
              f"{last['loss']:.4f}; {saved} in {out}", flush=True)
    elif main:
        print(f"nothing to do: the run is already at step {trainer.step} of {t.max_steps}; "
              "raise train.max_steps (--max-steps) to train further.", flush=True)


def _banner(cfg: RecipeConfig, pmesh: ParallelMesh, parts: _ModelParts, trainer,
            rows: int) -> str:
    t = cfg.train
    start = f", resuming at step {trainer.step}" if trainer.step else ""
    return (f"lctrain finetune: {parts.n_params / 1e6:.2f}M parameters, seq_len "
            f"{cfg.data.seq_len}, {rows} packed rows; {pmesh.world_size} x "
            f"{pmesh.device_type} (dp {pmesh.dp} x cp {pmesh.cp}, {cfg.parallel.schedule}, "
            f"{parts.distributed.strategy}); {t.max_steps} steps x "
            f"{pmesh.dp * t.batch_size * t.grad_accum} sequence(s){start}")


def _layout(pmesh: ParallelMesh) -> dict:
    return {"dp": pmesh.dp, "cp": pmesh.cp}


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
