"""Where the work runs: this process, processes started here, or one rank of a launcher's job.

`dispatch` is how a run starts (`lctrain.train.runner.finetune` hands it the worker to run):

- under a launcher (``torchrun``, ``accelerate launch``: RANK / LOCAL_RANK in the environment)
  this process is one rank of the job and runs the worker itself;
- otherwise, once the checks that need no process have passed (`check_before_start`: process
  layout, schedule on this device, remat-offload's host memory, the output folder), one process
  runs the worker here and several are started through torch.distributed.run:

      python -m lctrain.train.agent output_dir/.launch/failures.json --nnodes 1 \\
          --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint PRIVATE/rendezvous \\
          --rdzv-conf store_type=file -m lctrain.train --config PRIVATE/recipe.yaml \\
          --config-sha256 ... --error-dir output_dir/.launch/errors --store PRIVATE/store [--resume]

  where PRIVATE is a temporary folder of this user's alone (`spawn_workers`): nothing listens
  on a network port, and no worker reads a file that another process could swap.

  (`lctrain.train.agent` runs torch.distributed.run with these arguments in its own session,
  dies with this process and writes how each failed rank ended). Rank 0's progress goes straight to
  this terminal (stdout is inherited); the workers' stderr (library warnings, torchrun's own
  reports) goes to ``output_dir/.launch/workers.log``. While the ranks run, this process
  watches them (`Supervisor`): a stop signal (SIGTERM, SIGINT, SIGHUP) is passed to every rank,
  which stop together after their current step (`lctrain.train.stopping`); a second one kills
  them at once; once a rank has recorded a failure and exited, the others get
  `KILL_GRACE_S` seconds, then SIGKILL (a stopped or stuck rank never ends by itself). Then it
  reports the cause (`lctrain.train.failures.explain`): a rank's one-sentence error, the rank
  killed by a signal and the step, a hang and the ranks that did not arrive — with where the
  last checkpoint is and the command that resumes — or a bug's traceback.

One run owns its output folder (`lctrain.train.lifetime.RunLock`): a second run into it stops
with a sentence naming the other run's pid; the lock dies with its holder.

In every worker process `worker_process` makes the process a rank: accelerate's `Accelerator`
reads the launcher's environment, joins the process group (gloo on CPU, NCCL on GPUs) with the
recipe's collective timeout (`group_timeout`), picks the device and sets mixed precision; a
lone process gets a one-rank group, so that every code path (mesh, counts, DCP checkpoints) is
the same. On GPUs torch's NCCL flight recorder is on and dumps each rank's last collectives to
``output_dir/.launch/nccl_trace_rank_R`` when a collective times out. `worker_main` is the body
of ``python -m lctrain.train``.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs

from lctrain.config import RecipeConfig, check_run_folder, save_resolved
from lctrain.config.loader import build_checked, parse_yaml
from lctrain.config.paths import decode_text
from lctrain.config.resume import check_writable
from lctrain.errors import UserError, as_user_error
from lctrain.memory.host import check_cpu_memory, check_host_memory
from lctrain.parallel.context import check_runnable
from lctrain.parallel.mesh import check_parallel_sizes
from lctrain.train.checkpoint import list_checkpoints, resume_point
from lctrain.train.failures import record_error
from lctrain.train.lifetime import LAUNCHER_PID_ENV, RunLock, die_with_parent
from lctrain.train.stopping import resume_command
from lctrain.train.supervisor import Supervisor, report
from lctrain.train.watchdog import heartbeat_dir

USER_ERROR_EXIT = 2
WORKER_MODULE = "lctrain.train"
"""What each self-launched process runs (``python -m lctrain.train``: `worker_main`)."""
AGENT_MODULE = "lctrain.train.agent"
"""The launcher's child that runs torch.distributed.run (`lctrain.train.agent`)."""
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
    check_writable(Path(cfg.train.output_dir))  # said plainly, before the lock file goes in
    with RunLock(cfg.train.output_dir):
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


def launch_dir(cfg: RecipeConfig) -> Path:
    """``output_dir/.launch``: the self-launch's recipe copy, logs, error records, heartbeats."""
    return Path(cfg.train.output_dir) / ".launch"


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
                                    record_wait=_nccl_wait(cfg) + 30.0)
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


def read_recipe(path: str, sha256: str | None) -> RecipeConfig:
    """The recipe the launcher wrote, read once and checked against its SHA-256.

    Raises:
        UserError: the file changed since the launcher wrote it, or is not a valid recipe.
    """
    data = Path(path).read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise UserError(f"the recipe {path} changed after the launcher wrote it; start the run "
                        "again (and let nothing else write to that folder).")
    return build_checked(parse_yaml(decode_text(data, path), path), path, {})


def _worker_env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env[LAUNCHER_PID_ENV] = str(os.getpid())  # the agent and the ranks die with this process
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
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


def group_timeout(cfg: RecipeConfig) -> timedelta:
    """The process groups' timeout: ``train.collective_timeout`` plus a margin, so that the
    watchdog (`lctrain.train.watchdog`), which names the late ranks, speaks first; on NCCL
    torch's own timeout then dumps the flight recorder."""
    seconds = cfg.train.collective_timeout
    return timedelta(seconds=seconds + max(10.0, seconds / 10))


def _nccl_wait(cfg: RecipeConfig) -> float:
    """Seconds from a hang report until torch's NCCL timeout has dumped and aborted."""
    return group_timeout(cfg).total_seconds() - cfg.train.collective_timeout + 30.0


def hang_handler(cfg: RecipeConfig, device_type: str) -> Callable[[str], None]:
    """What a rank's watchdog does on a hang (`lctrain.train.watchdog`): record the report for
    the launcher, print it, and end the process. On NCCL it first waits for torch's own timeout
    (`group_timeout`), which dumps the flight recorder and aborts the process itself."""
    errors = launch_dir(cfg) / "errors"
    wait = _nccl_wait(cfg) if device_type == "cuda" else 0.0

    def on_hang(message: str) -> None:
        record_error(errors, kind="hang", message=message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        time.sleep(wait)
        os._exit(1)

    return on_hang


def worker_main(worker: Worker, argv: list[str] | None = None) -> int:
    """A self-launched rank: read the recipe, join the process group, run ``worker``, record a
    failure for the parent."""
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}")
    parser.add_argument("--config", required=True, help="resolved recipe YAML")
    parser.add_argument("--config-sha256", default=None, help="the recipe file's SHA-256")
    parser.add_argument("--error-dir", default=None, help="where a failing rank records why")
    parser.add_argument("--store", default=None, help="file store of the process group")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = read_recipe(args.config, args.config_sha256)
        if args.store is not None:
            _init_group_from_file(args.store, cfg)
        return worker(cfg, resume=args.resume)
    except BaseException as exc:
        user = as_user_error(exc)
        record_error(args.error_dir, user or exc)
        if user is None:
            raise
        print(f"error: {user}", file=sys.stderr)
        return USER_ERROR_EXIT
    finally:
        if args.store is not None and dist.is_initialized():
            dist.destroy_process_group()


def _init_group_from_file(store: str, cfg: RecipeConfig) -> None:
    """Join the launcher's process group through the file store ``store`` (rank and world
    size from torch.distributed.run's environment), with the recipe's `group_timeout` and, on
    GPUs, the NCCL flight recorder on."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        nccl_flight_recorder(launch_dir(cfg))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=group_timeout(cfg))


@contextlib.contextmanager
def worker_process(cfg: RecipeConfig) -> Iterator[Accelerator]:
    """This process as one rank of the run, for the duration of the block.

    The process group is the caller's when one exists (tests); otherwise accelerate makes it
    from the launcher's environment with `group_timeout`, or — a lone process — a one-rank group
    is made here. A group made for the block is destroyed at its end. Under a launcher on GPUs,
    remat-offload's host memory is checked for this machine's processes. The recipe, not the
    launcher, decides mixed precision and sharding.

    Yields:
        The `Accelerator`: device, mixed precision (``train.mixed_precision``) and autocast.

    Raises:
        UserError: accelerate was set up to shard the model itself, or remat-offload would pin
            more host memory than this machine has.
    """
    cuda = torch.cuda.is_available()
    own_group = not dist.is_initialized()
    if cuda:
        nccl_flight_recorder(launch_dir(cfg))
    timeout = group_timeout(cfg)
    if timeout == timedelta(seconds=600):  # accelerate drops a timeout equal to its default
        timeout += timedelta(seconds=1)
    # One accumulation step, whatever the environment says: the loop accumulates train.grad_accum
    # micro-batches itself and accelerate must not scale their losses (lctrain.train.loop).
    accelerator = Accelerator(cpu=not cuda, mixed_precision=mixed_precision(cfg, cuda),
                              gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    check_accelerate_mode(accelerator.distributed_type)
    store_dir = _ensure_process_group(accelerator.device, timeout)
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


def nccl_flight_recorder(folder: Path) -> None:
    """Turn on torch's NCCL flight recorder (the last collectives of each rank, in memory) and
    its dump on a timeout into ``folder/nccl_trace_rank_R``, unless the environment already
    says otherwise. Read when the NCCL process groups are made, so call this before."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "nccl_trace_rank_"))


def _ensure_process_group(device: torch.device, timeout: timedelta) -> str | None:
    """Make a one-rank group when none exists (a lone process, not under a launcher).

    Returns:
        The temporary folder of its file store (to delete at the end), or None.
    """
    if dist.is_initialized():
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    store_dir = tempfile.mkdtemp(prefix="lctrain-pg-")
    dist.init_process_group(backend, init_method=f"file://{os.path.join(store_dir, 'store')}",
                            rank=0, world_size=1, timeout=timeout)
    return store_dir
