"""Build the causal language model: a local folder, a hub name, or random init from a config.

Whichever the source, the model comes back with the "lctrain" attention selected (registered
through transformers' public `AttentionInterface`), its KV cache off (training), and its
parameters on the requested device in the requested dtype. Random initialisation is seeded, so
every rank builds the very same weights (FSDP2 then shards them; replication keeps them).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from lctrain.errors import UserError
from lctrain.model.attention import register_attention

_PATH_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def load_model(source: str | None, *, config: dict[str, Any] | None, seed: int,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               attn_implementation: str | None = None,
               trust_remote_code: bool = False) -> torch.nn.Module:
    """Load or build an AutoModelForCausalLM.

    Args:
        source: a local model folder or a hub name; None to build from ``config``.
        config: transformers config fields (with ``model_type``) for a randomly initialised
            model; used only when ``source`` is None.
        seed: seed of the random initialisation (identical on every rank).
        dtype: parameter dtype.
        device: where the parameters live.
        attn_implementation: defaults to the registered "lctrain" attention.
        trust_remote_code: allow model code from the folder or the hub to run.

    Returns:
        The model, in train mode, with ``config.use_cache = False``.

    Raises:
        UserError: no source and no config, a local path that does not exist, a hub name that
            cannot be fetched (offline or unknown), or an invalid config.
    """
    attn = attn_implementation or register_attention()
    if source is None:
        if not config:
            raise UserError("The recipe names no model: set model.path to a local folder "
                            "or hub name, or model.config to build a randomly initialised one.")
        model = _from_config(config, seed=seed, dtype=dtype, device=device, attn=attn)
    else:
        model = _from_pretrained(source, dtype=dtype, attn=attn, trust=trust_remote_code)
        model = model.to(device)
    model.config.use_cache = False
    model.train()
    return model


def _from_config(config: dict[str, Any], *, seed: int, dtype, device, attn) -> torch.nn.Module:
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise UserError("model.config needs a model_type (for example model_type: llama) to "
                        "build a randomly initialised model.")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"model.config.model_type '{model_type}' is not a model type this "
                        "transformers knows; use one such as llama, mistral or qwen2.")
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        raise UserError(f"model.config is not a valid '{model_type}' config: {exc}") from None
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=dtype)


def _from_pretrained(source: str, *, dtype, attn, trust: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    local = os.path.expanduser(source)
    if source.startswith(_PATH_PREFIXES) and not os.path.exists(local):
        raise UserError(f"The model folder {source} does not exist; fix model.path or "
                        "build a random model with model.config.")
    if os.path.exists(local) and not os.path.isdir(local):
        raise UserError(f"The model path {source} is a file, not a model folder with "
                        "config.json; point model.path at the folder.")
    try:
        return AutoModelForCausalLM.from_pretrained(
            local if os.path.isdir(local) else source, dtype=dtype, attn_implementation=attn,
            trust_remote_code=trust)
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"Could not load model '{source}' (offline, unknown hub name, or not a "
                        f"model folder): {first}; use a local folder or model.config.") from None
