"""`export_run`: one checkpoint of a run → a Hugging Face folder (what ``lctrain export`` calls).
The model is built on ``meta`` as training built it, so that its names match the checkpoint's,
and the weights are assigned in place, on the CPU in this one process."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from lctrain.checkpoint.reader import find_checkpoint, read_model_weights
from lctrain.config import LoraConfig, RecipeConfig, read_resolved
from lctrain.errors import UserError, unwritable
from lctrain.export import write
from lctrain.model import load_model
from lctrain.model.lora import apply_lora

DTYPES = ("float32", "bfloat16")
LORA_PARTS = (".lora_A.", ".lora_B.", ".modules_to_save.")  # what LoRA adds to the base


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote (``kind``: "full", "adapter" or "merged"; ``files`` relative to
    ``output``)."""

    output: Path
    step: int
    kind: str
    dtype: str
    base: str | None
    files: tuple[str, ...]

    @property
    def tokenizer_note(self) -> str:
        """"" when a tokenizer was written, else the sentence saying why not (byte-pairs)."""
        if any(name.startswith("tokenizer") for name in self.files):
            return ""
        return ("no tokenizer: the run's byte-pairs tokenizer has no transformers equivalent; "
                "tokenize with lctrain's own (lctrain.data.load_tokenizer)")


def export_run(run_dir: str | Path, *, output: str | Path, step: int | None = None,
               dtype: str | None = None, merge: bool = False,
               replace: bool = False) -> ExportResult:
    """Export the checkpoint of ``step`` (default: the newest) of the run in ``run_dir`` into
    ``output`` (new or empty unless ``replace``), in one of DTYPES (default ``model.dtype``:
    nothing rounded unless asked); ``merge``: a LoRA run's adapters into the base weights."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise UserError(f"there is no run folder {run}; pass the train.output_dir of an lctrain "
                        "finetune run.")
    if not (run / "config.yaml").is_file():
        raise UserError(f"{run} is not an lctrain run folder: it has no config.yaml (finetune "
                        "writes one when it starts); pass the train.output_dir of a run.")
    cfg = read_resolved(run / "config.yaml")
    step, checkpoint = find_checkpoint(run / "checkpoints", step)
    out = Path(output).expanduser()
    _check_output(out, replace)
    if merge and not cfg.lora.enabled:
        raise UserError(f"the run {run} trained every weight (lora.rank is 0), so there is no "
                        "adapter to merge; export it without --merge.")
    dtype = dtype or cfg.model.dtype
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one an export can be written in; use "
                        f"{' or '.join(DTYPES)}.")
    return _export(cfg, checkpoint, step, out, dtype=dtype, merge=merge, replace=replace)


def export_final(cfg: RecipeConfig) -> ExportResult:
    """Write (or replace) ``train.output_dir/final/`` from the run's newest checkpoint."""
    run = Path(cfg.train.output_dir)
    return export_run(run, output=run / "final", replace=True)


def _check_output(out: Path, replace: bool) -> None:
    """Refuse an output that is or lies under a file, or is not empty (unless ``replace``)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"the output {out} is a file; name a new folder.")
    above = next((folder for folder in out.parents if folder.exists()), None)
    if above is not None and not above.is_dir():
        raise UserError(f"the output {out} cannot be written ({above} is a file, not a "
                        "folder); choose a folder you may write to.")
    if not replace and out.is_dir() and any(out.iterdir()):
        raise UserError(f"the output folder {out} exists and is not empty; name a new folder "
                        "or empty that one.")


def _export(cfg: RecipeConfig, checkpoint: Path, step: int, out: Path, *, dtype: str,
            merge: bool, replace: bool) -> ExportResult:
    torch_dtype = getattr(torch, dtype)
    kind = "merged" if merge else "adapter" if cfg.lora.enabled else "full"
    base = None
    # staged first: an output that cannot be written fails before minutes of loading
    with write.staged_folder(out, replace=replace) as folder:
        tokenizer = write.run_tokenizer(cfg)
        specials = write.builtin_special_ids(cfg)  # bytes and byte-pairs: the ids trained on
        model = trained_model(cfg, checkpoint)
        write.align_special_ids(model, specials)
        try:
            if kind == "full":
                write.write_full(model, folder, torch_dtype)
            elif kind == "merged":  # every adapter merged into its base weight in float32
                merged = model.to(torch.float32).merge_and_unload(progressbar=False)
                write.write_full(merged, folder, torch_dtype)
            else:
                base = _write_adapter(cfg, model, folder, out, torch_dtype, tokenizer, specials)
            write.save_tokenizer(tokenizer, folder)
        except OSError as error:  # a full disk, a quota: the writes, not the reads above
            raise unwritable(f"the output {out}", error) from None
    files = tuple(sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()))
    return ExportResult(output=out, step=step, kind=kind, dtype=dtype, base=base, files=files)


def _write_adapter(cfg: RecipeConfig, model, folder: Path, out: Path, dtype: torch.dtype,
                   tokenizer, specials: dict[str, int] | None) -> str:
    """Write the adapter (and a random init's base model under ``base/``); return the base."""
    if cfg.model.path is not None:
        local = Path(cfg.model.path).expanduser()
        base = str(local.resolve()) if local.is_dir() else cfg.model.path
    else:
        base = str((out / "base").resolve())
        plain = skeleton(replace(cfg, lora=LoraConfig()))
        write.align_special_ids(plain, specials)
        plain.load_state_dict(base_weights(model.state_dict()), assign=True)  # built on meta
        if getattr(plain.config, "tie_word_embeddings", False):
            plain.tie_weights()
        write.write_full(plain, folder / "base", dtype)
        write.save_tokenizer(tokenizer, folder / "base")
    write.write_adapter(model, folder, dtype, base)
    return base


def trained_model(cfg: RecipeConfig, checkpoint: Path) -> nn.Module:
    """The model of ``checkpoint`` (a peft model for a LoRA run) on the CPU, in its saved dtype
    (UserError: the checkpoint does not match the recipe's model)."""
    model = skeleton(cfg)
    state = model.state_dict(keep_vars=True)
    weights = read_model_weights(checkpoint, list(state))
    by_identity = {id(state[name]): tensor for name, tensor in weights.items()}
    missing = [name for name, placeholder in state.items() if id(placeholder) not in by_identity]
    if missing:
        raise UserError(f"the checkpoint {checkpoint} has no weight {missing[0]} (and "
                        f"{len(missing) - 1} more missing); the run's config.yaml describes "
                        "another model than the one trained.")
    wrong = [(n, tuple(t.shape), tuple(state[n].shape)) for n, t in weights.items()
             if t.shape != state[n].shape]
    if wrong:
        name, saved, built = wrong[0]
        raise UserError(f"the checkpoint's {name} has shape {saved} but the run's recipe builds "
                        f"{built}; the config.yaml does not describe the trained model.")
    # tied weights (one parameter under two names) get the one tensor read for either name
    model.load_state_dict({n: by_identity[id(p)] for n, p in state.items()}, assign=True)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        model.tie_weights()  # assign gave each tied name a Parameter of its own
    model.eval()
    return model


def skeleton(cfg: RecipeConfig) -> nn.Module:
    """The recipe's model with its LoRA adapters, on the ``meta`` device (no weights)."""
    model = load_model(cfg.model.path, config=cfg.model.config, seed=cfg.train.seed,
                       dtype=getattr(torch, cfg.model.dtype), device="meta",
                       trust_remote_code=cfg.model.trust_remote_code,
                       seq_len=cfg.data.seq_len, cp=cfg.parallel.cp)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora, seed=cfg.train.seed)
    return model


def base_weights(peft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA run's state without adapters and trained copies, under the base model's names."""
    return {name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            .replace(".original_module.", "."): tensor
            for name, tensor in peft_state.items() if not any(p in name for p in LORA_PARTS)}
