"""One rank's process: joining the run through accelerate (`worker_process`; a lone process gets
a one-rank group, so every code path is the same), ``python -m lctrain.train``'s body
(`worker_main`) and ending on a hang."""
from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import io
import os
import shutil
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

from lctrain.config import RecipeConfig
from lctrain.config.loader import build_checked, parse_yaml
from lctrain.config.paths import decode_text
from lctrain.errors import UserError, as_user_error
from lctrain.memory.host import check_host_memory
from lctrain.launch.failures import record_error
from lctrain.launch.output import OUTPUT_LOG, kept_output

USER_ERROR_EXIT = 2
"""Exit code of a rank that stopped on a user error."""
WORKER_MODULE = "lctrain.train"


class Worker(Protocol):
    """One rank's run of a recipe; returns the exit code (`lctrain.train.runner.run_worker`)."""

    def __call__(self, cfg: RecipeConfig, *, resume: bool = False) -> int: ...


def launch_dir(cfg: RecipeConfig) -> Path:
    """``output_dir/.launch``: the self-launch's recipe copy, logs, error records, heartbeats."""
    return Path(cfg.train.output_dir) / ".launch"


def read_recipe(path: str, sha256: str | None) -> RecipeConfig:
    """The recipe the launcher wrote, read once and checked against its SHA-256 (UserError)."""
    data = Path(path).read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise UserError(f"the recipe {path} changed after the launcher wrote it; start the run "
                        "again (and let nothing else write to that folder).")
    return build_checked(parse_yaml(decode_text(data, path), path), path, {})


def group_timeout(cfg: RecipeConfig) -> timedelta:
    """``train.collective_timeout`` plus a margin, so that the watchdog, which names the late
    ranks, speaks before torch's own timeout (which dumps NCCL's flight recorder)."""
    seconds = cfg.train.collective_timeout
    return timedelta(seconds=seconds + max(10.0, seconds / 10))


def group_backend(cfg: RecipeConfig, cuda: bool) -> str:
    """The default group's backends: on GPUs NCCL, with gloo beside it where the state lives on
    the host (``train.offload`` state: FSDP2's CPU offload keeps the gradients there, and their
    norm is reduced over the world); only then, as gloo connects every pair of ranks at start."""
    if not cuda:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cfg.train.layers.state == "state" else "nccl"


def nccl_wait(cfg: RecipeConfig) -> float:
    """Seconds from a hang report until torch's NCCL timeout has dumped and aborted."""
    return group_timeout(cfg).total_seconds() - cfg.train.collective_timeout + 30.0


def hang_handler(cfg: RecipeConfig, device_type: str) -> Callable[[str], None]:
    """What a rank's watchdog does on a hang: record and print the report, then end the
    process (on NCCL after torch's own timeout has dumped the flight recorder)."""
    errors = launch_dir(cfg) / "errors"
    wait = nccl_wait(cfg) if device_type == "cuda" else 0.0

    def on_hang(message: str) -> None:
        record_error(errors, kind="hang", message=message)
        print(f"error: {message}", file=sys.stderr, flush=True)
        time.sleep(wait)
        os._exit(1)

    return on_hang


def worker_main(worker: Worker, argv: list[str] | None = None) -> int:
    """A self-launched rank: read the recipe, join the group, run ``worker``, record a failure."""
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}")
    parser.add_argument("--config", required=True, help="resolved recipe YAML")
    parser.add_argument("--config-sha256", default=None, help="the recipe file's SHA-256")
    parser.add_argument("--error-dir", default=None, help="where a failing rank records why")
    parser.add_argument("--store", default=None, help="file store of the process group")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    cfg = None
    try:
        cfg = read_recipe(args.config, args.config_sha256)
        with kept_output(launch_dir(cfg) / OUTPUT_LOG):
            if args.store is not None:  # join the launcher's group through its file store
                cuda = torch.cuda.is_available()
                if cuda:
                    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                    nccl_flight_recorder(launch_dir(cfg))
                dist.init_process_group(group_backend(cfg, cuda),
                                        init_method=f"file://{args.store}",
                                        rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]),
                                        timeout=group_timeout(cfg))
            return worker(cfg, resume=args.resume)
    except BaseException as exc:
        name_the_file(exc, cfg and cfg.train.output_dir)
        user = as_user_error(exc)
        machine = user is not None and isinstance(exc, OSError)  # a full disk, a permission
        record_error(args.error_dir, user or exc, kind="environment" if machine else None)
        if user is None:
            raise
        print(f"error: {user}", file=sys.stderr)
        return USER_ERROR_EXIT
    finally:
        if args.store is not None and dist.is_initialized():
            dist.destroy_process_group()


def name_the_file(error: BaseException, folder: str | os.PathLike | None) -> None:
    """Give a full disk's OSError that names no file (a failed write or close of an open
    file, maybe in another thread) the name of the file open for writing in the innermost
    frame that holds one, else ``folder`` when its disk is full."""
    if not isinstance(error, OSError) or error.errno not in (errno.ENOSPC, errno.EDQUOT) \
            or error.filename is not None:
        return
    tb = error.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            name = getattr(value, "name", None)
            if isinstance(value, io.IOBase) and isinstance(name, (str, bytes)) \
                    and any(c in getattr(value, "mode", "") for c in "wax+"):
                error.filename = os.fsdecode(name)
        tb = tb.tb_next
    with contextlib.suppress(OSError, TypeError):
        if error.filename is None and shutil.disk_usage(folder).free < 2**20:
            error.filename = os.fspath(folder)


@contextlib.contextmanager
def worker_process(cfg: RecipeConfig) -> Iterator[Accelerator]:
    """This process as one rank of the run for the block; yields the `Accelerator`. The group is
    the caller's, else accelerate's from the environment, else a one-rank group made here."""
    cuda = torch.cuda.is_available()
    own_group = not dist.is_initialized()
    if cuda:
        nccl_flight_recorder(launch_dir(cfg))
    timeout = group_timeout(cfg)
    if timeout == timedelta(seconds=600):  # accelerate drops a timeout equal to its default
        timeout += timedelta(seconds=1)
    precision = cfg.train.mixed_precision  # "bf16" or "no"; "auto": bf16 on GPUs that have it
    if precision == "auto":
        precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"
    # one accumulation step: the loop accumulates itself and accelerate must not scale losses
    accelerator = Accelerator(cpu=not cuda, mixed_precision=precision,
                              gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    check_accelerate_mode(accelerator.distributed_type)
    store_dir = None
    if not dist.is_initialized():  # neither the caller's nor accelerate's: a one-rank group
        store_dir = tempfile.mkdtemp(prefix="lctrain-pg-")
        dist.init_process_group(group_backend(cfg, accelerator.device.type == "cuda"),
                                init_method=f"file://{os.path.join(store_dir, 'store')}",
                                rank=0, world_size=1, timeout=timeout)
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
    """Refuse (UserError) accelerate's FSDP, DeepSpeed or Megatron-LM: lctrain shards the model
    itself (FSDP2)."""
    if mode in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise UserError(f"accelerate is set up for {mode.value} (an accelerate launch option or "
                        "its config file), but lctrain shards the model itself with FSDP2 "
                        "(parallel.fsdp); launch with --multi_gpu and without --use_fsdp, "
                        "--use_deepspeed or --use_megatron_lm.")


def nccl_flight_recorder(folder: Path) -> None:
    """Turn on torch's NCCL flight recorder and its dump on a timeout into
    ``folder/nccl_trace_rank_R`` (unless the environment says otherwise); call it before the
    NCCL groups are made."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / "nccl_trace_rank_"))
