"""Atomic training checkpoints with torch.distributed.checkpoint (DCP), and exact resume.

Layout under ``output_dir/checkpoints/``:

    step-00000100/            a complete checkpoint (only complete ones carry this name)
        .metadata, *.distcp   model + optimizer state, written by every rank through DCP
                              (FSDP2 shards and replicated tensors alike; DCP de-duplicates)
        trainer.pt            scheduler state, step, data position, dp/cp layout (rank 0)
        rng-rank{r}.pt        torch / CUDA / Python RNG states of rank r
        meta.json             the step and data position, for people
    .tmp-step-00000200/       a save in progress; renamed to step-00000200 only once every
                              rank has finished writing, so a crash never leaves a checkpoint
                              that looks complete

After each save the oldest complete checkpoints beyond ``keep`` are deleted. Saving and loading
are collective: all ranks call them (they synchronise with barriers of the default group).
`read_model_weights` is not: it reads a checkpoint's model weights in one process, on the CPU,
whatever the number of ranks that wrote it (``lctrain export``).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lctrain.errors import UserError

_NAME = re.compile(r"^step-(\d{8})$")


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), root / entry.name) for entry in root.iterdir()
             if entry.is_dir() and (m := _NAME.match(entry.name))]
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(root: str | os.PathLike, step: int, *, module, optimizer, scheduler,
                    data_position: int, layout: dict, keep: int) -> Path:
    """Write a checkpoint of ``step`` atomically, then keep only the newest ``keep``.

    Args:
        root: the checkpoints folder (created if missing).
        step: optimizer steps completed.
        module: the trained module (FSDP2-sharded or replicated).
        optimizer, scheduler: their states are saved with the model.
        data_position: micro-batches this dp rank has consumed (identical on all ranks).
        layout: {"dp": ..., "cp": ...} of the run, checked when resuming.
        keep: complete checkpoints to keep (≥ 1).

    Returns:
        The final checkpoint folder.
    """
    root = Path(root)
    rank = _rank()
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):
            shutil.rmtree(stale)
        tmp.mkdir()
    _barrier()
    model_state, optim_state = get_state_dict(module, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    if rank == 0:
        trainer = {"step": step, "data_position": data_position, "layout": dict(layout),
                   "scheduler": scheduler.state_dict()}
        torch.save(trainer, tmp / "trainer.pt")
        (tmp / "meta.json").write_text(json.dumps(
            {"step": step, "data_position": data_position, "layout": dict(layout)}) + "\n")
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def load_checkpoint(path: str | os.PathLike, *, module, optimizer, scheduler,
                    layout: dict) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG states from ``path``.

    Returns:
        {"step": int, "data_position": int}.

    Raises:
        UserError: the checkpoint was written with a different dp/cp layout.
    """
    path = Path(path)
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    if trainer["layout"] != dict(layout):
        raise UserError(f"The checkpoint {path} was written with {trainer['layout']} but this run "
                        f"has {dict(layout)}; resume with the same number of processes and "
                        "parallel.cp.")
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    scheduler.load_state_dict(trainer["scheduler"])
    _set_rng_state(torch.load(path / f"rng-rank{_rank()}.pt", weights_only=False))
    _barrier()
    return {"step": int(trainer["step"]), "data_position": int(trainer["data_position"])}


def find_resume_checkpoint(root: str | os.PathLike) -> Path:
    """The checkpoint ``--resume`` continues from.

    Raises:
        UserError: there is none.
    """
    path = latest_checkpoint(root)
    if path is None:
        raise UserError(f"There is no checkpoint to resume from in {root}; run without --resume "
                        "to start fresh, or point train.output_dir at the earlier run.")
    return path


def find_checkpoint(root: str | os.PathLike, step: int | None = None) -> tuple[int, Path]:
    """The complete checkpoint of ``step`` under ``root`` (the newest when None).

    Returns:
        (step, folder).

    Raises:
        UserError: there is no complete checkpoint, or none of ``step`` (the message lists the
            steps there are).
    """
    found = list_checkpoints(root)
    if not found:
        raise UserError(f"There is no complete checkpoint in {root}; train with "
                        "checkpoint.enabled true (a checkpoint is saved after the last step).")
    if step is None:
        return found[-1]
    for saved, path in found:
        if saved == step:
            return saved, path
    steps = ", ".join(str(s) for s, _ in found)
    raise UserError(f"There is no checkpoint of step {step} in {root}; it holds step(s) {steps}.")


def read_model_weights(path: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """Read saved model weights on the CPU, in this process alone, without the optimizer state.

    The checkpoint stores each weight under a prefix (the ``model`` entry, then the trained
    module's own prefix, e.g. ``model.model.``) and, for FSDP2, in shards: only the requested
    weights are read, assembled into whole tensors of their saved dtype. The prefix is found as
    the one under which the most of ``names`` are stored.

    Args:
        path: a checkpoint folder (``.../checkpoints/step-XXXXXXXX``).
        names: parameter and buffer names as in the model's ``state_dict()``.

    Returns:
        {name: tensor} for every name the checkpoint holds (names it lacks are left out).

    Raises:
        UserError: the folder is no readable checkpoint, or it holds none of ``names``.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(path))
    try:
        saved = reader.read_metadata().state_dict_metadata
    except (OSError, ValueError, RuntimeError) as error:
        raise UserError(f"The checkpoint {path} cannot be read ({type(error).__name__}); it may "
                        "be incomplete or from another program.") from None
    prefix = _weights_prefix(saved, names)
    if prefix is None:
        raise UserError(f"The checkpoint {path} holds none of the model's weights (for example "
                        f"{names[0]}); its run's config.yaml describes another model.")
    wanted = {}
    for name in names:
        meta = saved.get(prefix + name)
        if isinstance(meta, TensorStorageMetadata):
            wanted[prefix + name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    return {key[len(prefix):]: tensor for key, tensor in wanted.items()}


def _weights_prefix(saved, names: list[str]) -> str | None:
    """The key prefix under which the most of ``names`` are stored (None if none is)."""
    counts: dict[str, int] = {}
    for name in names[:1] + names[-1:]:  # candidates from two names; every name then votes
        for key in saved:
            candidate = key[:len(key) - len(name)]
            if key.endswith(name) and candidate.startswith("model.") and candidate.endswith("."):
                counts.setdefault(candidate, 0)
    for candidate in counts:
        counts[candidate] = sum(candidate + name in saved for name in names)
    best = max(counts, key=counts.get, default=None)
    return best if best is not None and counts[best] > 0 else None


def resume_point(root: str | os.PathLike, resume: bool) -> Path | None:
    """The checkpoint a run starts from: the newest under ``root`` with ``resume``, else None.

    Raises:
        UserError: ``resume`` without a checkpoint, or a fresh run into an output folder that
            holds checkpoints of an earlier run.
    """
    if resume:
        return find_resume_checkpoint(root)
    if list_checkpoints(root):
        raise UserError(f"{Path(root).parent} already holds checkpoints of an earlier run; pass "
                        "--resume to continue it, or choose another train.output_dir (or delete "
                        "that one).")
    return None


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
