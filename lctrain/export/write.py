"""Writers of the three export kinds, each into a folder that transformers or peft loads alone.

- full (a run that trained every weight): ``save_pretrained`` of the model — config.json,
  generation_config.json, safetensors shards of at most 5 GB (``model.safetensors`` when one
  shard is enough, else ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``);
- merged (a LoRA run, ``--merge``): the same, of the base weights with every adapter added in,
  W + B·A·alpha/r computed in float32 (peft's ``merge_and_unload``), and the fully trained
  modules replaced by their trained copies;
- adapter (a LoRA run): peft's ``save_pretrained`` — adapter_config.json (rank, alpha, targets,
  ``modules_to_save``, ``base_model_name_or_path``) and adapter_model.safetensors — for
  ``PeftModel.from_pretrained(base_model, folder)``. A random-init run has no base model folder,
  so its base weights (as initialised, frozen through training) go to ``base/`` beside the
  adapter, and the adapter names that folder as its base.

`staged_folder` makes the output appear whole or not at all.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from lctrain.errors import UserError

MAX_SHARD_SIZE = "5GB"
"""Largest safetensors shard (transformers' sharding; the Hugging Face Hub's usual size)."""


def write_full(model: nn.Module, folder: Path, dtype: torch.dtype,
               max_shard_size: str = MAX_SHARD_SIZE) -> None:
    """``save_pretrained`` of a plain transformers model in ``dtype``, ready for inference."""
    model.to(dtype)
    model.config.use_cache = True  # training switched the KV cache off; generation wants it
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)


def write_merged(peft_model: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """Merge every adapter into its base weight (in float32), then write the plain model."""
    peft_model.to(torch.float32)
    merged = peft_model.merge_and_unload(progressbar=False)
    write_full(merged, folder, dtype)


def write_adapter(peft_model: nn.Module, folder: Path, dtype: torch.dtype,
                  base_name: str) -> None:
    """peft's adapter files, naming ``base_name`` as the model to load the adapter onto."""
    from lctrain.model.lora import ADAPTER_NAME

    peft_model.to(dtype)
    peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = base_name
    # lctrain never resizes the vocabulary (embeddings trained in full travel as
    # modules_to_save); "auto" would look the base model up, on the hub if it is not local
    peft_model.save_pretrained(str(folder), save_embedding_layers=False)


def write_base(base: nn.Module, weights: dict[str, torch.Tensor], folder: Path,
               dtype: torch.dtype) -> None:
    """Write ``weights`` (from `lctrain.export.weights.base_weights`) as the plain model
    ``base`` (built on ``meta``, with the run's config)."""
    base.load_state_dict(weights, assign=True)
    if getattr(base.config, "tie_word_embeddings", False):
        base.tie_weights()
    write_full(base, folder, dtype)


@contextlib.contextmanager
def staged_folder(output: Path, *, replace: bool) -> Iterator[Path]:
    """Yield a fresh folder beside ``output`` to write into; move it to ``output`` at the end.

    ``output`` is replaced only when ``replace`` is set or it is an empty folder (the caller
    has checked). On an error the staged folder, and the parent folders made for it, are
    deleted and ``output`` is left as it was, so a failed export leaves nothing behind.

    Raises:
        UserError: the staged folder cannot be made or moved into place (no permission, a
            read-only or pseudo file system such as /proc, a full disk), with the system's
            reason. Errors of the caller's writes pass through (see `unwritable`).
    """
    made = [folder for folder in (output.parent, *output.parent.parents) if not folder.exists()]
    staging = output.parent / f".{output.name}.export-tmp"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    except OSError as error:
        _remove_empty(made)
        raise unwritable(output, error) from None
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(made)
        raise
    try:
        if output.exists() and replace:
            shutil.rmtree(output)
        elif output.exists():
            output.rmdir()  # empty, as checked
        os.replace(staging, output)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(made)
        raise unwritable(output, error) from None


def unwritable(output: Path, error: OSError) -> UserError:
    """The one-sentence error of an output folder that cannot be written, worded as
    ``lctrain finetune`` words an unwritable ``train.output_dir`` (with the system's reason)."""
    return UserError(f"The output {output} cannot be written "
                     f"({error.strerror or type(error).__name__}); choose a folder you may "
                     "write to, on a disk with free space.")


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders an export made (deepest first) that are still empty."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def listing(folder: Path) -> tuple[str, ...]:
    """The files under ``folder``, as sorted relative paths."""
    return tuple(sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()))
