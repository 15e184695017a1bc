"""Build the causal language model: a model folder or hub name (with the recipe's config
overrides on top), or a random init from a config.

Whichever the source, the transformers config is resolved first (`lctrain.model.hf_config`) and
checked against what lctrain can train exactly (`lctrain.model.features`) before any weight
loads. The model comes back with the "lctrain" attention selected (registered through
transformers' public `AttentionInterface`), its KV cache off (training), and its parameters on
the requested device in the requested dtype. Random initialisation is seeded, so every rank
builds the very same weights (FSDP2 then shards them; replication keeps them).
"""
from __future__ import annotations

import glob
import os
from typing import Any

import torch

from lctrain.config.hub import cache_only
from lctrain.errors import UserError
from lctrain.model.attention import register_attention
from lctrain.model.features import check_model_config
from lctrain.model.hf_config import first_line, resolve_config

_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
"""How a model folder's weight files are named (safetensors, or the older pickled format)."""


def load_model(source: str | None, *, config: dict[str, Any] | None, seed: int,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               attn_implementation: str | None = None, trust_remote_code: bool = False,
               seq_len: int | None = None, cp: int = 1) -> torch.nn.Module:
    """Load or build an AutoModelForCausalLM.

    Args:
        source: a local model folder or a hub name; None to build from ``config``.
        config: with ``source``, overrides of its config (RoPE scaling, max_position_embeddings,
            ...); without, the transformers config fields (with ``model_type``) of a randomly
            initialised model.
        seed: seed of the random initialisation (identical on every rank).
        dtype: parameter dtype.
        device: where the parameters live.
        attn_implementation: defaults to the registered "lctrain" attention.
        trust_remote_code: allow model code from the folder or the hub to run.
        seq_len: tokens per training row, to check windows and positions against (None: the
            attention call checks the window when it runs).
        cp: context-parallel ranks sharing a sequence (for RoPE types that depend on it).

    Returns:
        The model, in train mode, with ``config.use_cache = False``.

    Raises:
        UserError: no source and no config, a placeholder or missing path, a folder without
            weights, a hub name that cannot be fetched, an invalid config, or a model feature
            lctrain cannot train exactly.
    """
    attn = attn_implementation or register_attention()
    hf_config = resolve_config(source, config, trust_remote_code=trust_remote_code)
    check_model_config(hf_config, seq_len=seq_len, cp=cp)
    if source is None:
        torch.manual_seed(seed)
        with torch.device(device):
            model = _from_config(hf_config, dtype=dtype, attn=attn, trust=trust_remote_code)
    else:
        model = _from_pretrained(source, hf_config, dtype=dtype, attn=attn,
                                 trust=trust_remote_code).to(device)
    model.config.use_cache = False
    model.train()
    return model


def check_model(cfg: Any) -> list[str]:
    """Check a recipe's model before any process starts or any weight loads.

    Resolves the config (folder + overrides, or the random init's), checks it against what
    lctrain trains exactly at ``data.seq_len`` and ``parallel.cp``, and checks that a local
    folder holds weights.

    Args:
        cfg: the `lctrain.config.RecipeConfig`.

    Returns:
        Warnings to show the user, one sentence each.

    Raises:
        UserError: what `load_model` would raise for this recipe, short of loading weights.
    """
    from lctrain.config import require_model_path

    model = cfg.model
    hf_config = resolve_config(model.path, model.config, trust_remote_code=model.trust_remote_code)
    warnings = check_model_config(hf_config, seq_len=cfg.data.seq_len, cp=cfg.parallel.cp)
    if model.path is not None:
        check_weights(require_model_path(model.path))
    return warnings


def check_weights(source: str) -> None:
    """Raise UserError when the local folder ``source`` holds no weight files (a hub name passes).

    Raises:
        UserError: a folder with config.json but no ``*.safetensors`` (or ``*.bin``) weights.
    """
    folder = os.path.expanduser(source)
    if not os.path.isdir(folder):
        return
    if not any(glob.glob(os.path.join(folder, pattern)) for pattern in _WEIGHT_FILES):
        raise UserError(f"The model folder {source} has a config.json but no weights "
                        f"(*.safetensors); point model.path at the folder that holds them, or "
                        f"build a random init with model.config alone.")


def _from_config(hf_config: Any, *, dtype, attn: str, trust: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=dtype,
                                            trust_remote_code=trust)


def _from_pretrained(source: str, hf_config: Any, *, dtype, attn: str,
                     trust: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    check_weights(source)
    local = os.path.expanduser(source)
    # With the hub out of reach, the weights come from the local hub cache at once; the look-up
    # of a PEFT adapter config is told too, as transformers does not pass local_files_only on.
    only = cache_only(source)
    cache = {"local_files_only": True, "adapter_kwargs": {"local_files_only": True}} if only else {}
    try:
        return AutoModelForCausalLM.from_pretrained(
            local if os.path.isdir(local) else source, config=hf_config, dtype=dtype,
            attn_implementation=attn, trust_remote_code=trust, **cache)
    except OSError as exc:
        first = first_line(exc)
        raise UserError(f"Could not load model '{source}' (offline, unknown hub name, or not a "
                        f"model folder): {first}; use a local folder or model.config.") from None


def load_tokenizer(cfg: Any) -> Any:
    """The recipe's tokenizer (`lctrain.data.load_tokenizer`), checked against the vocabulary
    of the recipe's model.

    Raises:
        ConfigError: the tokenizer has more ids than the model has embeddings (and what
            `lctrain.data.load_tokenizer` raises).
    """
    from lctrain.data import load_tokenizer as load

    model = cfg.model
    config = resolve_config(model.path, model.config, trust_remote_code=model.trust_remote_code)
    return load(cfg, config.get_text_config().vocab_size)
