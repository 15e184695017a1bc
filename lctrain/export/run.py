"""`export_run`: one checkpoint of a run → a Hugging Face folder (what ``lctrain export`` calls).

It reads the run's ``config.yaml`` (the resolved recipe) to rebuild the model, the checkpoint's
model weights (`lctrain.export.weights`), writes the kind of folder the run calls for
(`lctrain.export.write`) with the run's tokenizer (`lctrain.export.tokenizer`), and makes the
folder appear whole. Everything runs on the CPU in this one process; the memory needed is about
the saved weights once (float32 master weights: 4 bytes per parameter), plus the converted
copy when the export's dtype differs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from lctrain.config import LoraConfig, RecipeConfig, read_resolved
from lctrain.errors import UserError

DTYPES = ("float32", "bfloat16")
"""Data types an export can be written in."""


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        output: the folder.
        step: the checkpoint's step.
        kind: "full" (every weight trained), "adapter" (LoRA adapter) or "merged" (LoRA merged
            into the base weights).
        dtype: the data type of the written weights.
        tokenizer: where the tokenizer came from ("bytes" for lctrain's byte tokenizer).
        base: the base model folder the adapter is to be loaded onto (adapters only).
        files: the files written, relative to ``output``.
    """

    output: Path
    step: int
    kind: str
    dtype: str
    tokenizer: str
    base: str | None
    files: tuple[str, ...]


def export_run(run_dir: str | Path, *, output: str | Path, step: int | None = None,
               dtype: str | None = None, merge: bool = False,
               replace: bool = False) -> ExportResult:
    """Export one checkpoint of a finished (or running) training run.

    Args:
        run_dir: the run's folder (its ``train.output_dir``: config.yaml, checkpoints/).
        output: the folder to write; it must not exist or be empty unless ``replace``.
        step: the checkpoint's step (default: the newest).
        dtype: ``float32`` or ``bfloat16`` (default: the dtype the weights were trained in,
            ``model.dtype``, so nothing is rounded unless asked).
        merge: for a LoRA run, write the base weights with the adapters merged in instead of
            the adapter.
        replace: replace an existing ``output`` (``finetune``'s own ``final/``).

    Returns:
        An `ExportResult`.

    Raises:
        UserError: no such run, no checkpoint (of ``step``), an output folder that is not
            empty or cannot be written, ``merge`` for a run without LoRA, a dtype that is not
            supported, or a checkpoint that does not match the run's recipe.
    """
    run = Path(run_dir).expanduser()
    cfg = run_config(run)
    from lctrain.checkpoint.reader import find_checkpoint

    step, checkpoint = find_checkpoint(run / "checkpoints", step)
    out = Path(output).expanduser()
    _check_output(out, replace)
    if merge and not cfg.lora.enabled:
        raise UserError(f"The run {run} trained every weight (lora.rank is 0), so there is no "
                        "adapter to merge; export it without --merge.")
    dtype = dtype or cfg.model.dtype
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one an export can be written in; use "
                        f"{' or '.join(DTYPES)}.")
    return _export(cfg, checkpoint, step, out, dtype=dtype, merge=merge, replace=replace)


def export_final(cfg: RecipeConfig) -> ExportResult:
    """Write ``train.output_dir/final/`` from the run's newest checkpoint (replacing an older
    ``final/``): full weights, or the adapter for a LoRA run, in the training dtype."""
    run = Path(cfg.train.output_dir)
    return export_run(run, output=run / "final", replace=True)


def run_config(run: Path) -> RecipeConfig:
    """The resolved recipe of the run in folder ``run``.

    Raises:
        UserError: there is no such folder, or it holds no config.yaml.
    """
    if not run.is_dir():
        raise UserError(f"There is no run folder {run}; pass the train.output_dir of an lctrain "
                        "finetune run.")
    if not (run / "config.yaml").is_file():
        raise UserError(f"{run} is not an lctrain run folder: it has no config.yaml (finetune "
                        "writes one when it starts); pass the train.output_dir of a run.")
    return read_resolved(run / "config.yaml")


def _check_output(out: Path, replace: bool) -> None:
    """Refuse an output that is a file, lies under a file, or is a folder with files in it
    (unless ``replace``), before anything is loaded or written."""
    if out.exists() and not out.is_dir():
        raise UserError(f"The output {out} is a file; name a new folder.")
    above = next((folder for folder in out.parents if folder.exists()), None)
    if above is not None and not above.is_dir():
        raise UserError(f"The output {out} cannot be written ({above} is a file, not a "
                        "folder); choose a folder you may write to.")
    if not replace and out.is_dir() and any(out.iterdir()):
        raise UserError(f"The output folder {out} exists and is not empty; name a new folder "
                        "or empty that one.")


def _export(cfg: RecipeConfig, checkpoint: Path, step: int, out: Path, *, dtype: str,
            merge: bool, replace: bool) -> ExportResult:
    from lctrain.export import tokenizer as tok
    from lctrain.export import write
    from lctrain.export.weights import trained_model

    torch_dtype = getattr(torch, dtype)
    kind = "merged" if merge else "adapter" if cfg.lora.enabled else "full"
    base = None
    # staged first: an output that cannot be written fails before minutes of loading
    with write.staged_folder(out, replace=replace) as folder:
        tokenizer, is_bytes = tok.run_tokenizer(cfg)
        model = trained_model(cfg, checkpoint)
        if is_bytes:
            tok.align_special_ids(model.config, getattr(model, "generation_config", None))
        try:
            if kind == "full":
                write.write_full(model, folder, torch_dtype)
            elif kind == "merged":
                write.write_merged(model, folder, torch_dtype)
            else:
                base = _write_adapter(cfg, model, folder, out, torch_dtype, tokenizer, is_bytes)
            tok.save_tokenizer(tokenizer, folder)
        except OSError as error:  # a full disk, a quota: the writes, not the reads above
            raise write.unwritable(out, error) from None
    source = ("bytes" if is_bytes else "none (byte-pairs has no transformers tokenizer)"
              if tokenizer is None else str(cfg.data.tokenizer or cfg.model.path))
    return ExportResult(output=out, step=step, kind=kind, dtype=dtype, tokenizer=source,
                        base=base, files=write.listing(out))


def _write_adapter(cfg: RecipeConfig, model, folder: Path, out: Path, dtype: torch.dtype,
                   tokenizer, is_bytes: bool) -> str:
    """Write the adapter (and, for a random-init run, its base model under ``base/``);
    return the base model's folder or hub name."""
    from lctrain.export import tokenizer as tok
    from lctrain.export import write
    from lctrain.export.weights import base_weights, skeleton

    if cfg.model.path is not None:
        local = Path(cfg.model.path).expanduser()
        base = str(local.resolve()) if local.is_dir() else cfg.model.path
    else:
        base = str((out / "base").resolve())
        plain = skeleton(dataclasses.replace(cfg, lora=LoraConfig()))
        if is_bytes:
            tok.align_special_ids(plain.config, getattr(plain, "generation_config", None))
        write.write_base(plain, base_weights(model.state_dict()), folder / "base", dtype)
        tok.save_tokenizer(tokenizer, folder / "base")
    write.write_adapter(model, folder, dtype, base)
    return base
