"""Writing training checkpoints atomically (every rank writes ``.tmp-step-N``, rank 0 renames
it ``step-N`` once all have), and on GPUs in the background: DCP copies the state to host
memory and writes it from a thread, one save in flight, a failure said at the next save or end."""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from lctrain.config.paths import ordinary_permissions
from lctrain.errors import UserError
from lctrain.checkpoint.reader import FORMAT, barrier, list_checkpoints, root_cause


class Checkpointer:
    """Saves one run's checkpoints into ``root``, the newest ``keep`` (collective)."""

    def __init__(self, root: str | os.PathLike, *, module, optimizer, keep: int,
                 asynchronous: bool, local_processes: int = 1) -> None:
        self.root, self.module, self.optimizer, self.keep = Path(root), module, optimizer, keep
        self.asynchronous, self.local_processes = asynchronous, local_processes
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._stager = self._hook = None
        self._pending: _Pending | None = None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in [*self.root.glob(".tmp-step-*"), *self.root.glob(".del-step-*")]:
                shutil.rmtree(stale, ignore_errors=True)
        barrier(self.group)

    def save(self, step: int, trainer_state: dict) -> Path:
        """Checkpoint now with ``trainer_state``; the folder (UserError: a write failed)."""
        self.wait()
        final, tmp = self.root / f"step-{step:08d}", self.root / f".tmp-step-{step:08d}"
        if final.exists():  # this step is saved already (same step, same state)
            return final
        model_state, optim_state = get_state_dict(self.module, self.optimizer)
        state = {"model": model_state, "optim": {"state": optim_state["state"]}}
        size = state_bytes(state)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            _write_rng(tmp / f"rng-rank{self.rank}.safetensors")
            if self.rank == 0:
                trainer = tmp / "trainer.json"
                trainer.write_text(json.dumps({"format": FORMAT, **trainer_state}, indent=1) + "\n",
                                   encoding="utf-8")
                fsync(trainer)
        except (OSError, SafetensorError) as error:  # safetensors' own I/O errors
            raise _failed_write(step, tmp, error, size) from None
        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        if not self._use_async(size):
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group,
                         no_dist=self.group is None)
                if self.rank == 0:
                    publish(tmp, final, keep=self.keep)
            except (OSError, CheckpointException) as error:
                raise _failed_write(step, tmp, error, size) from None
            barrier(self.group)
            return final
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the step's updates are in memory
        response = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                  async_stager=self._stager, no_dist=self.group is None)
        pending = self._pending = _Pending(step, tmp, size, response.staging_completion, Future())

        def written(upload: Future) -> None:  # runs in DCP's writing thread
            try:
                upload.result()
                if self.rank == 0:
                    publish(tmp, final, keep=self.keep)
                pending.published.set_result(final)
            except BaseException as error:  # noqa: BLE001 - reported by `wait`
                pending.published.set_exception(error)

        response.upload_completion.add_done_callback(written)
        return final

    def wait(self) -> Path | None:
        """Wait for the save in flight; its folder, or None (UserError: its write failed)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error = pending.published.exception()  # once it is written
        if error is not None:
            raise _failed_write(pending.step, pending.tmp, error, pending.size)
        return pending.published.result()

    def close(self) -> Path | None:
        """Wait for the last save, then release the staging memory (every rank, at the end)."""
        try:
            return self.wait()
        finally:
            barrier(self.group)
            if self._hook is not None:
                self._hook.remove()
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _use_async(self, size: int) -> bool:
        """Whether this save goes to the background (not when a host copy would not fit)."""
        if not self.asynchronous:
            return False
        if self._stager is not None:
            if not _stager_reusable():  # the previous save has finished (save waited for it)
                self._stager.close()
                self._stager = _new_stager()
            return True
        from lctrain.memory.host import available_host_bytes

        available = available_host_bytes()  # the local processes' host copies fit half of it
        fits = torch.tensor([int(available is None
                                 or size * self.local_processes <= available // 2)])
        if self.group is not None:
            dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self.group)
        if not fits.item():
            self.asynchronous = False
            if self.rank == 0:
                print("checkpoints are written synchronously: a host copy of the training "
                      "state would not fit in the available host memory", flush=True)
            return False
        self._stager = _new_stager()
        self._hook = self.optimizer.register_step_pre_hook(self._before_update)
        return True

    def _before_update(self, optimizer, args, kwargs) -> None:
        """Optimizer step-pre-hook: the weights may change only once the copy is taken."""
        if self._pending is not None:
            self._pending.staged.result()


@dataclass(frozen=True)
class _Pending:
    """A save in flight: ``staged`` once the host copy is taken; ``published``, the final
    folder once DCP has written it and rank 0 has published it, or the error."""

    step: int
    tmp: Path
    size: int
    staged: Future
    published: Future


def publish(tmp: Path, final: Path, *, keep: int) -> None:
    """Flush ``tmp``, rename it to ``final`` (atomic), retire checkpoints beyond ``keep`` but
    the newest one whose step trained (`step_trained`): checkpoints of skipped steps hold
    the same weights and must not push it out."""
    fsync_tree(tmp)
    os.replace(tmp, final)
    fsync(final.parent, folder=True)
    found = list_checkpoints(final.parent)
    trained = next((path for _, path in reversed(found) if step_trained(path)), None)
    for step, old in found[:-keep]:
        if old == trained:
            continue
        doomed = old.with_name(f".del-step-{step:08d}")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def step_trained(checkpoint: Path) -> bool:
    """Whether the update of the checkpoint's own step was applied (trainer.json's ``trained``;
    true when it does not say: a checkpoint of an earlier lctrain, or an unreadable one)."""
    try:
        return json.loads((checkpoint / "trainer.json").read_text()).get("trained", True) \
            is not False
    except (OSError, ValueError, AttributeError):
        return True


def _write_rng(path: Path) -> None:
    """This rank's RNG states (torch, CUDA, Python) as safetensors."""
    from safetensors.torch import save_file

    version, words, gauss = random.getstate()
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, str(path), metadata={"python_version": str(version),
                                            "python_gauss": json.dumps(gauss)})
    ordinary_permissions(path)
    fsync(path)


def state_bytes(state: dict | torch.Tensor, prefix: str = "") -> int:
    """Bytes of this rank's tensors in ``state`` (its shards, for DTensors); TypeError (a bug)
    for anything but tensors in nested dicts, which DCP would pickle."""
    if isinstance(state, dict):
        return sum(state_bytes(value, f"{prefix}{key}.") for key, value in state.items())
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"checkpoint entry {prefix.rstrip('.')} is a {type(state).__name__}; "
                        "only tensors are saved")
    local = state.to_local() if hasattr(state, "to_local") else state
    return local.numel() * local.element_size()


def _new_stager(background: bool = True):
    """DCP's stager: the host copy taken in a background thread (pinned on GPUs); with
    ``background`` false, in the calling thread and unpinned."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = background and torch.cuda.is_available() and torch.cuda.is_initialized()
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                        use_async_staging=background, use_non_blocking_copy=cuda))


@functools.cache
def _stager_reusable() -> bool:
    """Whether one DefaultStager stages more than once (torch 2.11's does not; probed once)."""
    stager = _new_stager(background=False)
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
        return True
    except KeyError:
        return False
    finally:
        stager.close()


def _failed_write(step: int, tmp: Path, error: BaseException, size: int) -> UserError:
    """Remove the partial ``tmp`` (its space is free again); one sentence for the failed write,
    with the system's reason (a full disk said as such)."""
    reason = root_cause(error)
    try:
        free = shutil.disk_usage(tmp.parent).free
    except OSError:
        free = None
    if "No space left" not in reason and free is not None and free < size:
        reason = (f"No space left on device: this rank's part needs about {size / 2**20:.1f} "
                  f"MiB and {free / 2**20:.1f} MiB are free; {reason}")
    shutil.rmtree(tmp, ignore_errors=True)
    found = list_checkpoints(tmp.parent)
    last = (f"the last complete checkpoint, {found[-1][1]} (step {found[-1][0]}), is untouched"
            if found else f"{tmp.parent} holds no complete checkpoint yet")
    return UserError(f"writing the checkpoint of step {step} to {tmp} failed ({reason}); {last} — "
                     "free space or fix the folder's permissions, then resume with --resume.")


def fsync_tree(folder: str | os.PathLike) -> None:
    """Flush every file under ``folder`` and the folders themselves to stable storage."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            fsync(os.path.join(root, name))
        fsync(root, folder=True)


def fsync(path: str | os.PathLike, *, folder: bool = False) -> None:
    """Flush a written file, or a ``folder``'s entries (new names, renames), to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not folder:  # some file systems cannot sync a folder; its files are synced
            raise
    finally:
        os.close(fd)
