"""Reading training checkpoints (``checkpoints/step-NNNNNNNN/``: DCP's tensors, ``trainer.json``,
``rng-rank{r}.safetensors``): finding one and loading it into any process layout, unpickling
nothing (`lctrain.checkpoint.safe_load`)."""
from __future__ import annotations

import json
import os
import random
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from lctrain.errors import UserError
from lctrain.checkpoint.safe_load import SafeLoadPlanner, SafeReader

_NAME = re.compile(r"^step-(\d{8})$")
FORMAT = 2
"""Version of what a checkpoint folder holds (``trainer.json``'s ``format``)."""
_STATE_KEYS = {"format": int, "step": int, "rows_consumed": int, "tokens_consumed": int,
               "seq_len": int, "rows_per_step": int, "layout": dict, "lr_plan": dict}


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), root / entry.name) for entry in root.iterdir()
                  if entry.is_dir() and (m := _NAME.match(entry.name)))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def load_checkpoint(path: str | os.PathLike, *, module, optimizer) -> dict:
    """Restore model, optimizer and this rank's RNG states from ``path`` into the current
    sharding; trainer.json's content (UserError: a damaged, altered or other model's one)."""
    path = Path(path)
    trainer = read_trainer_state(path)
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optim": {"state": optim_state["state"]}}
    _load(path, state)
    optim_state = {"state": state["optim"]["state"], "param_groups": optim_state["param_groups"]}
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=optim_state)
    rng = path / f"rng-rank{dist.get_rank() if dist.is_initialized() else 0}.safetensors"
    if rng.exists():
        _read_rng(rng)
    barrier()
    return trainer


def read_trainer_state(path: str | os.PathLike) -> dict:
    """A checkpoint's ``trainer.json``, checked (UserError: missing or malformed)."""
    path = Path(path)
    file = path / "trainer.json"
    if not file.exists():
        older = " (trainer.pt: written by an older lctrain, whose pickled files are not " \
                "loaded)" if (path / "trainer.pt").exists() else ""
        raise UserError(f"the checkpoint {path} has no trainer.json{older}; resume from a "
                        "checkpoint of this lctrain, or start a fresh run.")
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"{file} cannot be read ({type(error).__name__}); the checkpoint is "
                        "damaged") from None
    bad = [k for k, kind in _STATE_KEYS.items()
           if not isinstance(state, dict) or not isinstance(state.get(k), kind)]
    if bad or state["format"] != FORMAT:
        raise UserError(f"{file} is not a trainer state of this lctrain (format {FORMAT}; "
                        f"missing or wrong: {', '.join(bad) or 'format'}).")
    return state


def find_checkpoint(root: str | os.PathLike, step: int | None = None) -> tuple[int, Path]:
    """(step, folder) of the complete checkpoint of ``step`` under ``root`` (the newest when
    None); UserError when there is none."""
    found = list_checkpoints(root)
    if not found:
        raise UserError(f"there is no complete checkpoint in {root}; train with "
                        "checkpoint.keep above 0 (a checkpoint is saved after the last step).")
    if step is None:
        return found[-1]
    if step in dict(found):
        return step, dict(found)[step]
    steps = ", ".join(str(s) for s, _ in found)
    raise UserError(f"there is no checkpoint of step {step} in {root}; it holds step(s) {steps}.")


def load_model(path: str | os.PathLike, module) -> None:
    """Restore only the model weights of the checkpoint ``path`` into ``module`` (every rank of
    its sharding), unpickling nothing; UserError: a damaged or altered file, another model."""
    state = {"model": get_model_state_dict(module)}
    _load(Path(path), state)
    set_model_state_dict(module, state["model"])


def _load(path: Path, state: dict, alone: bool = False) -> None:
    """``dcp.load`` of ``state`` from ``path`` through the safe reader and planner, by every
    rank of the process group (``alone``: by this process only)."""
    SafeReader(str(path)).read_metadata()  # refused here in its own words, not inside DCP's
    no_dist = alone or not dist.is_initialized()
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(),
                 no_dist=no_dist)
    except (CheckpointException, OSError, RuntimeError) as error:  # a missing or cut shard too
        if not (no_dist or isinstance(error, CheckpointException)):
            raise  # a collective that failed (a rank gone), not the files
        # a UserError inside (`SafeLoadPlanner`'s) says it all
        inner = next((e for e in _causes(error) if isinstance(e, UserError)), None)
        raise inner or UserError(f"the checkpoint {path} cannot be loaded into this model "
                                 f"({root_cause(error)}); it was written for another model or "
                                 "LoRA setting, or it is damaged.") from None


def read_model_weights(path: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """{name: whole tensor} of the saved model weights among ``names`` (``state_dict()`` names),
    read on the CPU in this process alone (UserError: none of them)."""
    reader = SafeReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    candidates = dict.fromkeys(  # key prefixes, from two names; every name then votes
        key[:len(key) - len(name)] for name in names[:1] + names[-1:] for key in saved
        if key.endswith(name))
    counts = {prefix: sum(prefix + name in saved for name in names) for prefix in candidates
              if prefix.startswith("model.") and prefix.endswith(".")}
    prefix = max(counts, key=counts.get, default=None)  # the one holding the most of them
    if prefix is None:
        raise UserError(f"the checkpoint {path} holds none of the model's weights (for example "
                        f"{names[0]}); its run's config.yaml describes another model.")
    wanted = {}
    for name in names:
        meta = saved.get(prefix + name)
        if isinstance(meta, TensorStorageMetadata):
            wanted[prefix + name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        _load(Path(path), wanted, alone=True)
    return {key[len(prefix):]: tensor for key, tensor in wanted.items()}


def resume_point(root: str | os.PathLike, resume: bool) -> Path | None:
    """The checkpoint a run starts from: the newest under ``root`` with ``resume``, else None.
    UserError: ``resume`` without a checkpoint, or a fresh run over an earlier run's ones."""
    if resume:
        path = latest_checkpoint(root)
        if path is None:
            raise UserError(f"there is no checkpoint to resume from in {root}; run without "
                            "--resume to start fresh, or point train.output_dir at the earlier "
                            "run.")
        return path
    if list_checkpoints(root):
        raise UserError(f"{Path(root).parent} already holds checkpoints of an earlier run; pass "
                        "--resume to continue it, or choose another train.output_dir (or delete "
                        "that one).")
    return None


def finished_checkpoint(root: str | os.PathLike, steps: int) -> tuple[int, Path] | None:
    """The newest checkpoint under ``root`` as (step, folder) when its step is ``steps`` or
    later (nothing is left to train), else None."""
    path = latest_checkpoint(root)
    if path is None:
        return None
    step = read_trainer_state(path)["step"]
    return (step, path) if step >= steps else None


def export_is_current(folder: str | os.PathLike, checkpoint: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a model exported from ``checkpoint`` or a later one: a config.json
    or adapter_config.json, and files no older than the checkpoint's trainer.json (an export
    records no step, so its files' times stand for it)."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):
        return False
    saved = (Path(checkpoint) / "trainer.json").stat().st_mtime
    return max(f.stat().st_mtime for f in folder.rglob("*") if f.is_file()) >= saved


def _read_rng(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        state = (int(meta["python_version"]), tuple(int(w) for w in tensors["python"].tolist()),
                 json.loads(meta["python_gauss"]))
        random.setstate(state)
        torch.set_rng_state(tensors["torch"])
    except Exception as error:  # noqa: BLE001 - safetensors' own errors, missing keys, shapes
        raise UserError(f"{path} is not an RNG state lctrain wrote ({type(error).__name__}); "
                        "the checkpoint is damaged") from None
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


def root_cause(error: BaseException) -> str:
    """The reason inside ``error``: the first operating-system error (DCP wraps each rank's
    exception in a CheckpointException), else the innermost exception's type and first line."""
    chain = []
    for item in _causes(error):
        if isinstance(item, OSError) and item.strerror:
            return item.strerror + (f": {item.filename}" if item.filename else "")
        chain.append(item)
    innermost = chain[-1]
    lines = str(innermost).strip().splitlines()
    name = type(innermost).__name__
    return f"{name}: {lines[0][:300]}" if lines else name


def _causes(error: BaseException):
    """``error`` and the exceptions inside it (DCP's per-rank failures, causes), outermost first."""
    todo = [error]
    while todo:
        item = todo.pop(0)
        yield item
        failures = getattr(item, "failures", None) or {}
        todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend(e for e in (item.__cause__, item.__context__) if e is not None)


def barrier(group=None) -> None:
    """Wait for every rank of ``group`` (default: all), when there are several."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)
