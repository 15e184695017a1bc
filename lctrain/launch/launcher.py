"""Where the work runs: this process, ranks started here through torch.distributed.run (file
stores in a private folder, no network port; a `Supervisor` watching them), or one rank of a
launcher's job (torchrun, accelerate launch)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from lctrain.config import RecipeConfig, check_run_folder, save_resolved
from lctrain.errors import UserError
from lctrain.memory.host import check_cpu_memory, check_host_memory
from lctrain.parallel.mesh import check_parallel_sizes
from lctrain.checkpoint.reader import list_checkpoints, resume_point
from lctrain.launch.lifetime import LAUNCHER_PID_ENV, RunLock, die_with_parent, private_folder
from lctrain.launch.output import OUTPUT_LOG, kept_output
from lctrain.launch.rank import WORKER_MODULE, Worker, launch_dir, nccl_wait
from lctrain.launch.supervisor import Supervisor, report
from lctrain.launch.watchdog import heartbeat_dir

AGENT_MODULE = "lctrain.launch.supervisor"  # the agent: `agent_main`


def dispatch(cfg: RecipeConfig, worker: Worker, *, resume: bool, nproc: int | None,
             module: str = WORKER_MODULE, args: tuple[str, ...] = (),
             own_process: bool = False) -> int:
    """Run ``worker`` on every rank the recipe needs (self-launched ranks run ``python -m MODULE
    ... ARGS``, even a lone one with ``own_process``); the exit code. UserError: a check or a
    rank failed."""
    if "RANK" in os.environ or "LOCAL_RANK" in os.environ:  # torchrun, accelerate launch
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's child: die with it
            die_with_parent()
        owner = os.environ.get("RANK", "0") == "0"  # rank 0 holds the output folder
        with RunLock(cfg.train.output_dir) if owner else contextlib.nullcontext():
            return worker(cfg, resume=resume)
    n = nproc if nproc is not None else default_nproc(cfg)
    with RunLock(cfg.train.output_dir):
        check_before_start(cfg, nproc=n, resume=resume, data=module == WORKER_MODULE)
        with kept_output(launch_dir(cfg) / OUTPUT_LOG):
            if n == 1 and not own_process:
                return worker(cfg, resume=resume)
            return spawn_workers(cfg, nproc=n, resume=resume, module=module, args=args)


def default_nproc(cfg: RecipeConfig) -> int:
    """All local GPUs on a CUDA machine; parallel.cp processes on a CPU-only one."""
    return torch.cuda.device_count() if torch.cuda.is_available() else cfg.parallel.cp


def check_before_start(cfg: RecipeConfig, *, nproc: int, resume: bool, data: bool = False) -> None:
    """What can fail (UserError) before any process starts, on a machine running ``nproc`` of
    them: the output folder, cp, this machine's memory and, for training (``data``), the first
    records of the data."""
    check_run_folder(cfg, resume=resume)
    check_parallel_sizes(nproc, cfg.parallel.cp)
    if torch.cuda.is_available():  # only GPU runs pin host memory
        if nproc > (gpus := torch.cuda.device_count()):  # a rank per GPU
            raise UserError(f"{nproc} processes need {nproc} GPUs, and this machine shows "
                            f"{gpus} (CUDA_VISIBLE_DEVICES included); use --nproc {gpus} or less")
        check_host_memory(cfg, local_processes=nproc, gpus=nproc)
    else:  # a CPU run holds the whole training state in host memory
        check_cpu_memory(cfg, processes=nproc)
        if nproc > (cores := os.cpu_count() or 1):
            print(f"warning: {nproc} processes share {cores} CPU cores and take turns on them, "
                  "which slows every step", file=sys.stderr, flush=True)
    resume_point(Path(cfg.train.output_dir) / "checkpoints", resume)
    if data:  # the ranks' DataError about the data's first records, at once
        from lctrain.data.check import check_first_records
        from lctrain.model import load_tokenizer

        check_first_records(cfg.data, lambda: load_tokenizer(cfg))


def spawn_workers(cfg: RecipeConfig, *, nproc: int, resume: bool, module: str = WORKER_MODULE,
                  args: tuple[str, ...] = ()) -> int:
    """Run ``nproc`` local ranks of ``python -m MODULE ... ARGS`` and watch them; returns 0, 128 +
    a stop signal, or 1 for a bug in a rank (UserError: a rank's UserError, death or hang)."""
    folder = launch_dir(cfg)
    errors, failures, log = folder / "errors", folder / "failures.json", folder / "workers.log"
    for stale in (errors, heartbeat_dir(cfg.train.output_dir)):
        shutil.rmtree(stale, ignore_errors=True)
    errors.mkdir(parents=True)
    for stale in (failures, folder / "stop"):
        stale.unlink(missing_ok=True)
    save = " and save a checkpoint" if cfg.checkpoint.enabled else ""
    text = (f"the ranks finish their current step{save}, then stop; send the signal again to "
            "stop at once.")
    with private_folder() as private:
        recipe = private / "recipe.yaml"  # resolved; the ranks check its SHA-256 (read_recipe)
        save_resolved(cfg, recipe)
        digest = hashlib.sha256(recipe.read_bytes()).hexdigest()
        # one machine, no network port: a file store (--standalone would listen on every interface)
        cmd = [sys.executable, "-m", AGENT_MODULE, str(failures), "--nnodes=1",
               f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={private / 'rendezvous'}", "--rdzv-conf=store_type=file",
               f"--rdzv-id=lctrain-{os.getpid()}-{time.time_ns()}", "-m", module,
               "--config", str(recipe), "--config-sha256", digest, "--error-dir", str(errors),
               "--store", str(private / "store"), *args]
        if resume:
            cmd.append("--resume")
        agent = subprocess.Popen(cmd, env=_worker_env(nproc), stderr=subprocess.PIPE,
                                 start_new_session=True)
        supervisor = Supervisor(agent, folder, on_signal_text=text,
                                record_wait=nccl_wait(cfg) + 30.0, log=log)
        code = supervisor.wait()
    # what to do next: resume a training run; an evaluation keeps nothing and simply starts again
    hint = (checkpoint_hint(cfg, nproc) if module == WORKER_MODULE
            else "nothing was kept; run the same command again")
    if code is not None:
        print(f"lctrain: stopped at once; {hint}.", file=sys.stderr)
        return code
    return report(supervisor, launch_dir=folder, failures=failures, log=log, checkpoint_hint=hint)


def keep_workers_log(output_dir: str | os.PathLike) -> Path | None:
    """Copy a self-launched run's ``.launch/workers.log`` beside ``output_dir`` (for callers
    that remove a scratch run folder); the copy, or None when no rank wrote one."""
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
    # many large tensor sizes: growing segments keep the allocator from holding unusable gigabytes
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # FlashAttention 4's on-disk cache of compiled kernels (file-locked, shared by the ranks)
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    with contextlib.suppress(OSError, StopIteration):  # loopback: lo on Linux, lo0 on macOS
        names = {name for _, name in socket.if_nameindex()}
        loopback = next(name for name in ("lo", "lo0") if name in names)
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    return env


def checkpoint_hint(cfg: RecipeConfig, nproc: int) -> str:
    """Where the newest complete checkpoint of the run is and the command that resumes it."""
    found = list_checkpoints(Path(cfg.train.output_dir) / "checkpoints")
    if not found:
        why = "checkpoint.keep is 0" if not cfg.checkpoint.enabled else "none was saved yet"
        return f"there is no checkpoint to resume from ({why})"
    step, path = found[-1]  # resumed from the run's own config.yaml
    config = shlex.quote(str(Path(cfg.train.output_dir) / "config.yaml"))
    flag = f" --nproc {nproc}" if nproc != default_nproc(cfg) else ""
    return (f"the last complete checkpoint is {path} (step {step}); resume with: "
            f"lctrain finetune {config} --resume{flag}")
