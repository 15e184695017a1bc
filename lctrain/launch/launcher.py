"""Where the work runs: this process, processes started here, or one rank of a launcher's job.

`dispatch` is how a run starts (`lctrain.train.runner.finetune` hands it the worker to run):

- under a launcher (``torchrun``, ``accelerate launch``: RANK / LOCAL_RANK in the environment)
  this process is one rank of the job and runs the worker itself;
- otherwise, once the checks that need no process have passed (`check_before_start`: process
  layout, schedule on this device, remat-offload's host memory, the output folder), one process
  runs the worker here and several are started through torch.distributed.run:

      python -m lctrain.launch.agent output_dir/.launch/failures.json --nnodes 1 \\
          --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint PRIVATE/rendezvous \\
          --rdzv-conf store_type=file -m lctrain.train --config PRIVATE/recipe.yaml \\
          --config-sha256 ... --error-dir output_dir/.launch/errors --store PRIVATE/store [--resume]

  where PRIVATE is a temporary folder of this user's alone (`spawn_workers`): nothing listens
  on a network port, and no worker reads a file that another process could swap.

  (`lctrain.launch.agent` runs torch.distributed.run with these arguments in its own session,
  dies with this process and writes how each failed rank ended). Rank 0's progress goes straight to
  this terminal (stdout is inherited); the workers' stderr (library warnings, torchrun's own
  reports) goes to ``output_dir/.launch/workers.log``. While the ranks run, this process
  watches them (`Supervisor`): a stop signal (SIGTERM, SIGINT, SIGHUP) is passed to every rank,
  which stop together after their current step (`lctrain.launch.stopping`); a second one kills
  them at once; once a rank has recorded a failure and exited, the others get
  `KILL_GRACE_S` seconds, then SIGKILL (a stopped or stuck rank never ends by itself). Then it
  reports the cause (`lctrain.launch.failures.explain`): a rank's one-sentence error, the rank
  killed by a signal and the step, a hang and the ranks that did not arrive — with where the
  last checkpoint is and the command that resumes — or a bug's traceback.

One run owns its output folder (`lctrain.launch.lifetime.RunLock`): a second run into it stops
with a sentence naming the other run's pid; the lock dies with its holder.

Each started process becomes a rank in `lctrain.launch.rank` (`worker_main`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lctrain.config import RecipeConfig, check_run_folder, save_resolved
from lctrain.memory.host import check_cpu_memory, check_host_memory
from lctrain.parallel.context import check_runnable
from lctrain.parallel.mesh import check_parallel_sizes
from lctrain.checkpoint.reader import list_checkpoints, resume_point
from lctrain.launch.lifetime import LAUNCHER_PID_ENV, RunLock, die_with_parent
from lctrain.launch.rank import WORKER_MODULE, Worker, launch_dir, nccl_wait
from lctrain.launch.stopping import resume_command
from lctrain.launch.supervisor import Supervisor, report
from lctrain.launch.watchdog import heartbeat_dir

AGENT_MODULE = "lctrain.launch.agent"
"""The launcher's child that runs torch.distributed.run (`lctrain.launch.agent`)."""
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK")


def dispatch(cfg: RecipeConfig, worker: Worker, *, resume: bool, nproc: int | None,
             module: str = WORKER_MODULE, args: tuple[str, ...] = (),
             own_process: bool = False) -> int:
    """Run ``worker`` on every rank the recipe needs; returns the exit code (0 on success).

    Args:
        cfg: the resolved recipe.
        worker: what each rank runs.
        resume: continue from the newest checkpoint.
        nproc: processes to run (default `default_nproc`); ignored under a launcher.
        module, args: what self-launched ranks run, ``python -m MODULE --config ... ARGS``
            (a module whose main runs ``worker``: `lctrain.train`, or `lctrain.eval`, whose
            ARGS name what to evaluate).
        own_process: run even a single rank in a process of its own (a benchmark does, so
            that nothing of one run — memory, caches, the allocator's peak — reaches the next).

    Raises:
        UserError: the output folder is in use by another run, a check before start failed,
            the first failing rank's UserError, or a rank that died or hung.
    """
    if under_launcher():
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's child: die with it
            die_with_parent()
        owner = os.environ.get("RANK", "0") == "0"  # rank 0 holds the output folder
        with RunLock(cfg.train.output_dir) if owner else contextlib.nullcontext():
            return worker(cfg, resume=resume)
    n = nproc if nproc is not None else default_nproc(cfg)
    with RunLock(cfg.train.output_dir):
        check_before_start(cfg, nproc=n, resume=resume)
        if n == 1 and not own_process:
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
        UserError: the output folder holds another run (or, on resume, a change the run
            cannot take), dp × cp does not fit ``nproc``, the schedule cannot run on this device,
            remat-offload would pin more host memory than the machine has, a CPU run's model
            would not fit in its memory, ``resume`` without a
            checkpoint, or a fresh run into a folder that holds checkpoints.
    """
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_run_folder(cfg, resume=resume)
    check_parallel_sizes(nproc, cfg.parallel.cp, cfg.parallel.dp or None)
    check_runnable(cfg.parallel.schedule, cfg.parallel.cp, device_type)
    if device_type == "cuda":  # only GPU runs pin host memory
        check_host_memory(cfg, local_processes=nproc, gpus=nproc)
    else:  # a CPU run holds the whole training state in host memory
        check_cpu_memory(cfg, processes=nproc)
    resume_point(Path(cfg.train.output_dir) / "checkpoints", resume)


def spawn_workers(cfg: RecipeConfig, *, nproc: int, resume: bool, module: str = WORKER_MODULE,
                  args: tuple[str, ...] = ()) -> int:
    """Run ``nproc`` local ranks of ``python -m MODULE`` through torch.distributed.run, watched
    until they end (``args`` go after the module's ``--config``, ``--error-dir`` and ``--store``).

    Returns:
        0 on success, 128 + the signal when a stop signal ended the run, 1 for a bug in a rank
        (its traceback is printed).

    What the workers need from the launcher lives in a private temporary folder (readable by
    this user only, removed at the end): the resolved recipe, whose SHA-256 each worker checks
    before using it, and the rendezvous and process-group file stores (so nothing listens on a
    network port: see `rendezvous_args`). Error records, heartbeats and the stop request are in
    `launch_dir`, where the ranks' watchdogs and the supervisor meet.

    Raises:
        UserError: the first failing rank's UserError, a rank killed by a signal, or a hang —
            each one sentence with the last checkpoint and the command that resumes.
    """
    folder = launch_dir(cfg)
    errors, failures, log = folder / "errors", folder / "failures.json", folder / "workers.log"
    for stale in (errors, heartbeat_dir(cfg.train.output_dir)):
        shutil.rmtree(stale, ignore_errors=True)
    errors.mkdir(parents=True)
    for stale in (failures, folder / "stop"):
        stale.unlink(missing_ok=True)
    save = " and save a checkpoint" if cfg.checkpoint.enabled and cfg.checkpoint.on_signal else ""
    text = (f"the ranks finish their current step{save}, then stop; send the signal again to "
            "stop at once.")
    with tempfile.TemporaryDirectory(prefix="lctrain-launch-") as private:
        private = Path(private)
        recipe, digest = write_recipe(cfg, private / "recipe.yaml")
        cmd = [sys.executable, "-m", AGENT_MODULE, str(failures),
               *rendezvous_args(private, nproc), "-m", module, "--config", str(recipe),
               "--config-sha256", digest, "--error-dir", str(errors),
               "--store", str(private / "store"), *args]
        if resume:
            cmd.append("--resume")
        with log.open("w") as stderr:
            agent = subprocess.Popen(cmd, env=_worker_env(nproc), stderr=stderr,
                                     start_new_session=True)
            supervisor = Supervisor(agent, folder, on_signal_text=text,
                                    record_wait=nccl_wait(cfg) + 30.0)
            code = supervisor.wait()
    # what to do next: resume a training run; an evaluation keeps nothing and simply starts again
    hint = (checkpoint_hint(cfg, nproc) if module == WORKER_MODULE
            else "nothing was kept; run the same command again")
    if code is not None:
        print(f"lctrain: stopped at once; {hint}.", file=sys.stderr)
        return code
    return report(supervisor, launch_dir=folder, failures=failures, log=log, checkpoint_hint=hint)


def rendezvous_args(private: Path, nproc: int) -> list[str]:
    """torch.distributed.run's arguments for one machine with nothing on a network port.

    ``--standalone`` starts a TCP store that listens on every interface (whatever host name it
    is given). Instead the rendezvous uses a file store in ``private``, `_worker_env` stops
    the agent from starting a TCP store for the workers (TORCH_DISABLE_SHARE_RDZV_TCP_STORE)
    and points gloo and NCCL at the loopback interface, and each worker joins its process group
    through another file store (`worker_main`'s ``--store``).
    """
    return ["--nnodes=1", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={private / 'rendezvous'}", "--rdzv-conf=store_type=file",
            f"--rdzv-id=lctrain-{os.getpid()}-{time.time_ns()}"]


def write_recipe(cfg: RecipeConfig, path: Path) -> tuple[Path, str]:
    """Save the resolved recipe for the workers; returns (path, SHA-256 of its bytes)."""
    save_resolved(cfg, path)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def keep_workers_log(output_dir: str | os.PathLike) -> Path | None:
    """Copy a self-launched run's ranks' log (``output_dir/.launch/workers.log``) beside
    ``output_dir``, for callers that remove a scratch run folder after a failure; the copy, or
    None when no rank wrote one."""
    folder = Path(output_dir)
    log = folder / ".launch" / "workers.log"
    if not log.is_file() or not log.stat().st_size:
        return None
    kept = folder.parent / f"{folder.name.lstrip('.')}-workers.log"
    shutil.copyfile(log, kept)
    return kept


def _worker_env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env[LAUNCHER_PID_ENV] = str(os.getpid())  # the agent and the ranks die with this process
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # long-context steps allocate tensors of many large sizes; growing segments instead of
    # fixed blocks keeps the allocator from holding gigabytes it cannot hand out
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # FlashAttention 4 compiles its kernels on first use; its on-disk cache (file-locked, so
    # ranks share it) lets later runs on the machine load them instead
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    loopback = _loopback_interface()
    if loopback is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    return env


def _loopback_interface() -> str | None:
    """The loopback network interface's name (lo on Linux, lo0 on macOS), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def checkpoint_hint(cfg: RecipeConfig, nproc: int) -> str:
    """Where the newest complete checkpoint of the run is and the command that resumes it."""
    found = list_checkpoints(Path(cfg.train.output_dir) / "checkpoints")
    if not found:
        why = ("checkpoint.enabled is false" if not cfg.checkpoint.enabled
               else "none was saved yet")
        return f"there is no checkpoint to resume from ({why})"
    step, path = found[-1]
    flag = nproc if nproc != default_nproc(cfg) else None
    return (f"the last complete checkpoint is {path} (step {step}); resume with: "
            f"{resume_command(cfg.train.output_dir, nproc=flag)}")
