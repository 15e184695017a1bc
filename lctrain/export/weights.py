"""The trained model of a checkpoint, rebuilt on the CPU from the run's recipe.

The architecture comes from the run's resolved recipe exactly as training built it
(`lctrain.model.load_model` on the ``meta`` device — no memory, no random init — then
`lctrain.model.lora.apply_lora` for a LoRA run), so the parameter names are those of the trained
module. The weights are then read from the DCP checkpoint (model part only, one process, any
number of ranks having written it) and put in place with ``load_state_dict(assign=True)``:
nothing is copied twice and nothing is left on ``meta`` but non-persistent buffers (RoPE's
inverse frequencies), which transformers recomputes when it loads the export.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lctrain.config import RecipeConfig
from lctrain.errors import UserError

LORA_PARTS = (".lora_A.", ".lora_B.", ".modules_to_save.")
"""Name parts of the weights a LoRA run adds to the base model (adapters, trained copies)."""


def trained_model(cfg: RecipeConfig, checkpoint: Path) -> nn.Module:
    """The model of ``checkpoint`` (a peft model for a LoRA run) on the CPU, in its saved dtype.

    Raises:
        UserError: the model cannot be built from the recipe (missing model folder, ...), or
            the checkpoint lacks weights the recipe's model has.
    """
    from lctrain.checkpoint.reader import read_model_weights

    model = skeleton(cfg)
    state = model.state_dict(keep_vars=True)
    weights = read_model_weights(checkpoint, list(state))
    by_identity: dict[int, torch.Tensor] = {}
    for name, tensor in weights.items():
        by_identity[id(state[name])] = tensor
    missing = [name for name, placeholder in state.items() if id(placeholder) not in by_identity]
    if missing:
        raise UserError(f"The checkpoint {checkpoint} has no weight {missing[0]} (and "
                        f"{len(missing) - 1} more missing); the run's config.yaml describes "
                        "another model than the one trained.")
    wrong = [(n, tuple(t.shape), tuple(state[n].shape)) for n, t in weights.items()
             if t.shape != state[n].shape]
    if wrong:
        name, saved, built = wrong[0]
        raise UserError(f"The checkpoint's {name} has shape {saved} but the run's recipe builds "
                        f"{built}; the config.yaml does not describe the trained model.")
    # tied weights (one parameter under two names) get the one tensor read for either name
    model.load_state_dict({n: by_identity[id(p)] for n, p in state.items()}, assign=True)
    _tie_again(model)
    model.eval()
    return model


def skeleton(cfg: RecipeConfig) -> nn.Module:
    """The recipe's model with its LoRA adapters, on the ``meta`` device (no weights)."""
    from lctrain.model import load_model

    model = load_model(cfg.model.path, config=cfg.model.config, seed=cfg.train.seed,
                       dtype=getattr(torch, cfg.model.dtype), device="meta",
                       trust_remote_code=cfg.model.trust_remote_code,
                       seq_len=cfg.data.seq_len, cp=cfg.parallel.cp)
    if cfg.lora.enabled:
        from lctrain.model.lora import apply_lora

        model = apply_lora(model, cfg.lora, seed=cfg.train.seed)
    return model


def base_weights(peft_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's weights inside a LoRA model's state: adapters and trained copies left
    out, peft's name parts (``base_model.model.``, ``.base_layer``, ``.original_module``) taken
    away — the weights the run started from."""
    base = {}
    for name, tensor in peft_state.items():
        if any(part in name for part in LORA_PARTS):
            continue
        plain = name.removeprefix("base_model.model.")
        plain = plain.replace(".base_layer.", ".").replace(".original_module.", ".")
        base[plain] = tensor
    return base


def _tie_again(model: nn.Module) -> None:
    """Re-tie the output head to the embeddings where the config ties them (``assign`` gave
    each name its own Parameter)."""
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
