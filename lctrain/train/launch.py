"""Where the work runs: this process, processes started here, or one rank of a launcher's job.

`dispatch` is how a run starts (`lctrain.train.runner.finetune` hands it the worker to run):

- under a launcher (``torchrun``, ``accelerate launch``: RANK / LOCAL_RANK in the environment)
  this process is one rank of the job and runs the worker itself;
- otherwise, once the checks that need no process have passed (`check_before_start`: process
  layout, schedule on this device, remat-offload's host memory, the output folder), one process
  runs the worker here and several are started through torch.distributed.run:

      python -m torch.distributed.run --standalone --nproc-per-node N \\
          -m lctrain.train --config output_dir/.launch/recipe.yaml --error-dir ... [--resume]

  Rank 0's progress goes straight to this terminal (stdout is inherited); the workers' stderr
  (library warnings, torchrun's own reports) goes to ``output_dir/.launch/workers.log``. When a
  rank fails it records its exception in the error folder; the parent then reports the FIRST
  failure in time — the real cause, not the "connection reset" that other ranks see next — as
  a `UserError` (one sentence) or, for a bug, as that rank's traceback.

In every worker process `worker_process` makes the process a rank: accelerate's `Accelerator`
reads the launcher's environment, joins the process group (gloo on CPU, NCCL on GPUs), picks the
device and sets mixed precision; a lone process gets a one-rank group, so that every code path
(mesh, counts, DCP checkpoints) is the same. `worker_main` is the body of ``python -m
lctrain.train``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, GradientAccumulationPlugin

from lctrain.config import RecipeConfig, load_recipe, save_resolved
from lctrain.errors import UserError
from lctrain.memory.host import check_host_memory
from lctrain.parallel.context import check_runnable
from lctrain.parallel.mesh import check_parallel_sizes
from lctrain.train.checkpoint import resume_point

USER_ERROR_EXIT = 2
WORKER_MODULE = "lctrain.train"
"""What each self-launched process runs (``python -m lctrain.train``: `worker_main`)."""
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK")


class Worker(Protocol):
    """One rank's run of a recipe; returns the exit code (`lctrain.train.runner.run_worker`)."""

    def __call__(self, cfg: RecipeConfig, *, resume: bool = False) -> int: ...


def dispatch(cfg: RecipeConfig, worker: Worker, *, resume: bool, nproc: int | None,
             module: str = WORKER_MODULE, args: tuple[str, ...] = ()) -> int:
    """Run ``worker`` on every rank the recipe needs; returns the exit code (0 on success).

    Args:
        cfg: the resolved recipe.
        worker: what each rank runs.
        resume: continue from the newest checkpoint.
        nproc: processes to run (default `default_nproc`); ignored under a launcher.
        module, args: what self-launched ranks run, ``python -m MODULE --config ... ARGS``
            (a module whose main runs ``worker``: `lctrain.train`, or `lctrain.eval`, whose
            ARGS name what to evaluate).

    Raises:
        UserError: a check before start failed, or the first failing rank's UserError.
    """
    if under_launcher():
        return worker(cfg, resume=resume)
    n = nproc if nproc is not None else default_nproc(cfg)
    check_before_start(cfg, nproc=n, resume=resume)
    if n == 1:
        return worker(cfg, resume=resume)
    return spawn_workers(cfg, nproc=n, resume=resume, module=module, args=args)


def under_launcher() -> bool:
    """Whether torchrun / accelerate launch started this process as one rank of a job."""
    return any(name in os.environ for name in _LAUNCHER_ENV)


def default_nproc(cfg: RecipeConfig) -> int:
    """All local GPUs on a CUDA machine; dp × cp processes on a CPU-only one (dp 0 counts as 1)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(cfg.parallel.dp, 1) * cfg.parallel.cp


def check_before_start(cfg: RecipeConfig, *, nproc: int, resume: bool) -> None:
    """What can fail before any process starts, on a machine running ``nproc`` of them.

    Raises:
        UserError: dp × cp does not fit ``nproc``, the schedule cannot run on this device,
            remat-offload would pin more host memory than the machine has, ``resume`` without a
            checkpoint, or a fresh run into a folder that holds checkpoints.
    """
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_parallel_sizes(nproc, cfg.parallel.cp, cfg.parallel.dp or None)
    check_runnable(cfg.parallel.schedule, cfg.parallel.cp, device_type)
    if device_type == "cuda":  # only GPU runs pin host memory
        check_host_memory(cfg, local_processes=nproc, gpus=nproc)
    resume_point(Path(cfg.train.output_dir) / "checkpoints", resume)


def spawn_workers(cfg: RecipeConfig, *, nproc: int, resume: bool, module: str = WORKER_MODULE,
                  args: tuple[str, ...] = ()) -> int:
    """Run ``nproc`` local ranks of ``python -m MODULE`` through torch.distributed.run; returns 0
    on success (``args`` go after the module's ``--config`` and ``--error-dir``).

    Raises:
        UserError: the first failing rank failed with a UserError (its message).
    """
    launch_dir = Path(cfg.train.output_dir) / ".launch"
    errors = launch_dir / "errors"
    shutil.rmtree(errors, ignore_errors=True)
    errors.mkdir(parents=True)
    recipe = save_resolved(cfg, launch_dir / "recipe.yaml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", module,
           "--config", str(recipe), "--error-dir", str(errors), *args]
    if resume:
        cmd.append("--resume")
    log = launch_dir / "workers.log"
    with log.open("w") as stderr:
        code = subprocess.run(cmd, env=_worker_env(nproc), stderr=stderr, check=False).returncode
    if code == 0:
        return 0
    first = first_error(errors)
    if first is None:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        print(f"training failed (exit code {code}); the workers' log is {log}", file=sys.stderr)
        return code or 1
    if first["user"]:
        raise UserError(first["message"])
    print(f"rank {first['rank']} failed:\n{first['traceback']}", file=sys.stderr)
    print(f"(the workers' log is {log})", file=sys.stderr)
    return code or 1


def _worker_env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def first_error(error_dir: str | os.PathLike) -> dict | None:
    """The earliest recorded rank failure in ``error_dir``, or None if no rank recorded one."""
    records = []
    for path in Path(error_dir).glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return min(records, key=lambda r: r["time"]) if records else None


def record_error(error_dir: str | os.PathLike | None, exc: BaseException) -> None:
    """Write this rank's failure as ``rank{R}.json`` (atomically) for the parent to report."""
    if error_dir is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "time": time.time(), "user": isinstance(exc, UserError),
              "message": str(exc) or type(exc).__name__,
              "traceback": "".join(traceback.format_exception(exc))}
    path = Path(error_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def worker_main(worker: Worker, argv: list[str] | None = None) -> int:
    """A self-launched rank: load the recipe, run ``worker``, record a failure for the parent."""
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}")
    parser.add_argument("--config", required=True, help="resolved recipe YAML")
    parser.add_argument("--error-dir", default=None, help="where a failing rank records why")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    try:
        return worker(load_recipe(args.config), resume=args.resume)
    except UserError as exc:
        record_error(args.error_dir, exc)
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    except BaseException as exc:
        record_error(args.error_dir, exc)
        raise


@contextlib.contextmanager
def worker_process(cfg: RecipeConfig) -> Iterator[Accelerator]:
    """This process as one rank of the run, for the duration of the block.

    The process group is the caller's when one exists (tests); otherwise accelerate makes it
    from the launcher's environment, or — a lone process — a one-rank group is made here. A
    group made for the block is destroyed at its end. Under a launcher on GPUs, remat-offload's
    host memory is checked for this machine's processes. The recipe, not the launcher, decides
    mixed precision and sharding.

    Yields:
        The `Accelerator`: device, mixed precision (``train.mixed_precision``) and autocast.

    Raises:
        UserError: accelerate was set up to shard the model itself, or remat-offload would pin
            more host memory than this machine has.
    """
    cuda = torch.cuda.is_available()
    own_group = not dist.is_initialized()
    # One accumulation step, whatever the environment says: the loop accumulates train.grad_accum
    # micro-batches itself and accelerate must not scale their losses (lctrain.train.loop).
    accelerator = Accelerator(cpu=not cuda, mixed_precision=mixed_precision(cfg, cuda),
                              gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1))
    check_accelerate_mode(accelerator.distributed_type)
    store_dir = _ensure_process_group(accelerator.device)
    try:
        if "LOCAL_WORLD_SIZE" in os.environ and accelerator.device.type == "cuda":
            check_host_memory(cfg, local_processes=int(os.environ["LOCAL_WORLD_SIZE"]),
                              gpus=dist.get_world_size())
        yield accelerator
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)


def check_accelerate_mode(mode: DistributedType) -> None:
    """Refuse accelerate's own model sharding (``accelerate launch --use_fsdp / --use_deepspeed``
    or its config file): lctrain shards the model itself (FSDP2, ``parallel.fsdp``).

    Raises:
        UserError: accelerate was set up for FSDP, DeepSpeed or Megatron-LM.
    """
    if mode in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise UserError(f"accelerate is set up for {mode.value} (an accelerate launch option or "
                        "its config file), but lctrain shards the model itself with FSDP2 "
                        "(parallel.fsdp); launch with --multi_gpu and without --use_fsdp, "
                        "--use_deepspeed or --use_megatron_lm.")


def mixed_precision(cfg: RecipeConfig, cuda: bool) -> str:
    """accelerate's ``mixed_precision``: "bf16" or "no" ("auto" = bf16 on GPUs that have it)."""
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
