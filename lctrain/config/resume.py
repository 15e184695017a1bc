"""A run's folder belongs to one run: a fresh run into it must have the same recipe;
``--resume`` continues from its config.yaml (`load_resumed`), and only the settings in
`RESUMABLE` may change (`resume_changes`)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from lctrain.config.loader import load_recipe, parse_override, read_resolved
from lctrain.config.schema import RecipeConfig
from lctrain.errors import ConfigError

RESUMABLE = (
    "train.max_steps", "train.epochs", "train.collective_timeout", "train.max_nonfinite_steps",
    "train.eval_every", "train.report_to", "train.batch_size", "train.grad_accum",
    "train.checkpointing", "train.offload", "train.host_memory", "train.loss_chunk_tokens",
    "train.tile_tokens", "parallel.cp", "parallel.schedule", "parallel.attention_backend",
    "parallel.fsdp", "parallel.head_groups", "model.fused_kernels",
    "checkpoint.every", "checkpoint.keep", "checkpoint.export_final")
"""Settings a resumed run may change: its length, intervals, faults, layout and memory trade-offs
(the global batch must stay); the others define what is trained."""


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as {dotted key: leaf} (lists and tuples are leaves, as lists)."""
    if isinstance(data, dict) and (data or not prefix):
        return {k: v for key, value in data.items()
                for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): list(data) if isinstance(data, tuple) else data}


def differences(saved: RecipeConfig, new: RecipeConfig) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, new value) for every setting that differs, in recipe order."""
    a, b = flatten(saved.to_dict()), flatten(new.to_dict())
    keys = [k for k in {**a, **b} if k != "train.output_dir"]
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]  # a moved run is its run


def resume_changes(saved: RecipeConfig, new: RecipeConfig,
                   source: str | os.PathLike) -> list[tuple[str, Any, Any]]:
    """The settings ``new`` changes in ``saved``'s run (ConfigError: one not in `RESUMABLE`)."""
    changes = differences(saved, new)
    for key, old, value in changes:
        if key not in RESUMABLE:
            raise ConfigError(
                f"--resume cannot change {key}: the run in {Path(source).parent} has {old!r} "
                f"({source}) but this command gives {value!r}; drop that change, or start a new "
                "run in another --output-dir (on resume only the run's length, logging and "
                "checkpoint intervals, the process layout and memory settings may change)", key=key)
    return changes


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """The line a resumed run prints: which settings it changed."""
    parts = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes)
    return f"resuming with changed settings: {parts}"


def check_run_folder(cfg: RecipeConfig, *, resume: bool) -> list[tuple[str, Any, Any]]:
    """Check that ``cfg`` may run in its folder; on resume, the settings it changes (ConfigError)."""
    out = Path(cfg.train.output_dir)
    check_writable(out)
    saved_file = out / "config.yaml"
    if resume:
        return resume_changes(_saved(saved_file), cfg, saved_file)
    if not saved_file.exists():
        return []
    changed = differences(_saved(saved_file), cfg)
    if changed and not never_trained(out):
        key, old, new = changed[0]
        raise ConfigError(f"{out} holds another run ({saved_file} has {key} = {old!r}, this "
                          f"run {new!r}); choose another --output-dir, resume that run with "
                          "--resume, or delete the folder", key=key)
    return []


def never_trained(folder: Path) -> bool:
    """Whether the run folder ``folder`` holds no completed step (no checkpoint, no logged
    step): a start that failed early, which a new start may take over."""
    metrics = folder / "metrics.jsonl"
    return (not any((folder / "checkpoints").glob("step-*"))
            and not (metrics.exists() and metrics.stat().st_size > 0))


def takes_over(cfg: RecipeConfig) -> bool:
    """Whether a fresh start of ``cfg`` replaces another recipe's run that never trained."""
    out = Path(cfg.train.output_dir)
    saved = out / "config.yaml"
    return (saved.exists() and never_trained(out)
            and bool(differences(_saved(saved), cfg)))


def check_writable(folder: Path) -> None:
    """Create ``folder`` and write a few bytes in it (ConfigError with the system's reason)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".lctrain-probe-")
        try:
            os.write(fd, b"lctrain\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(f"train.output_dir {folder} cannot be written ({reason}); choose a "
                          "folder you may write to, on a disk with free space",
                          key="train.output_dir") from None


def load_resumed(recipe: str | os.PathLike | None, overrides: Iterable[str] = (), *,
                 seq_len: int | str | None = None, output_dir: str | None = None,
                 max_steps: int | None = None) -> RecipeConfig:
    """The recipe ``--resume`` continues with: the run's, then ``recipe``, then the overrides."""
    overrides = list(overrides)
    if recipe is None and output_dir is None:  # --set train.output_dir=RUN is --output-dir RUN
        given = [value for key, value in map(parse_override, overrides)
                 if key == "train.output_dir"]
        output_dir = given[-1] if given and isinstance(given[-1], str) and given[-1] else None
    if recipe is not None or output_dir is None:
        cfg = load_recipe(recipe, overrides, seq_len=seq_len, output_dir=output_dir,
                          max_steps=max_steps)
        if recipe is not None:
            check_run_folder(cfg, resume=True)
            return cfg
        output_dir = cfg.train.output_dir
    saved_file = Path(output_dir).expanduser() / "config.yaml"
    saved = _saved(saved_file)
    cfg = load_recipe(saved_file, overrides, seq_len=seq_len, output_dir=output_dir,
                      max_steps=max_steps)
    resume_changes(saved, cfg, saved_file)
    return cfg


def _saved(path: Path) -> RecipeConfig:
    if not path.exists():
        raise ConfigError(f"there is no run to resume in {path.parent} (it has no config.yaml); "
                          "give the run's folder with --output-dir, or start it without --resume")
    try:
        return read_resolved(path)
    except ConfigError as error:
        raise ConfigError(f"{path} is not a run's recipe ({error}); give another --output-dir "
                          "or delete that folder") from None
