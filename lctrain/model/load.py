"""Build the causal language model from a model folder or hub name, or a seeded random init, after
its config is resolved and checked. The recipe's ``model.config`` overrides the folder's
config.json (``rope_theta`` / ``rope_scaling`` folded into ``rope_parameters``, keeping the
folder's ``rope_type``); it may change how the model computes but not its weights."""
from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from lctrain.config import require_model_path
from lctrain.config.hub import cache_only
from lctrain.errors import ConfigError, UserError, first_line
from lctrain.model.attention import register_attention
from lctrain.model.features import check_model_config, check_rope_type

_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
# config keys whose change leaves the weights as they are
_COMPUTE_ONLY = re.compile(r"^(rope_parameters|max_position_embeddings|sliding_window|"
                           r"use_sliding_window|max_window_layers|layer_types|use_cache|"
                           r"(bos|eos|pad)_token_id|.*(dropout|pdrop|softcap).*)$")


def load_model(source: str | None, *, config: dict[str, Any] | None, seed: int,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               attn_implementation: str | None = None, trust_remote_code: bool = False,
               seq_len: int | None = None, cp: int = 1) -> torch.nn.Module:
    """Load ``source`` (a model folder or hub name) with ``config`` overrides, or build a random
    init of ``seed`` from ``config`` alone, as an AutoModelForCausalLM in train mode without a
    cache (attention: "lctrain" by default); windows and positions are checked against
    ``seq_len`` over ``cp`` ranks. UserError: a model lctrain cannot load or train exactly."""
    from transformers import AutoModelForCausalLM

    attn = attn_implementation or register_attention()
    hf_config = resolve_config(source, config, trust_remote_code=trust_remote_code)
    check_model_config(hf_config, seq_len=seq_len, cp=cp)
    if source is None:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn,
                                                     dtype=dtype,
                                                     trust_remote_code=trust_remote_code)
    else:
        model = _from_pretrained(source, hf_config, dtype=dtype, attn=attn,
                                 trust=trust_remote_code).to(device)
    model.config.use_cache = False
    model.train()
    return model


def check_model(cfg: Any) -> list[str]:
    """Check a recipe's model (config, features, weights present) before any weight loads, as
    `load_model` would; return warnings, one sentence each."""
    model = cfg.model
    hf_config = resolve_config(model.path, model.config, trust_remote_code=model.trust_remote_code)
    warnings = check_model_config(hf_config, seq_len=cfg.data.seq_len, cp=cfg.parallel.cp)
    if model.path is not None:
        check_weights(require_model_path(model.path))
    return warnings


def check_weights(source: str) -> None:
    """Raise UserError when the local folder ``source`` holds no weight files (a hub name passes)."""
    folder = os.path.expanduser(source)
    if not os.path.isdir(folder):
        return
    if not any(glob.glob(os.path.join(folder, pattern)) for pattern in _WEIGHT_FILES):
        raise UserError(f"the model folder {source} has a config.json but no weights "
                        f"(*.safetensors); point model.path at the folder that holds them, or "
                        f"build a random init with model.config alone.")


def _from_pretrained(source: str, hf_config: Any, *, dtype, attn: str,
                     trust: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    check_weights(source)
    local = os.path.expanduser(source)
    # hub out of reach: the local hub cache, for the adapter look-up too (not passed on)
    only = cache_only(source)
    cache = {"local_files_only": True, "adapter_kwargs": {"local_files_only": True}} if only else {}
    try:
        return AutoModelForCausalLM.from_pretrained(
            local if os.path.isdir(local) else source, config=hf_config, dtype=dtype,
            attn_implementation=attn, trust_remote_code=trust, **cache)
    except OSError as exc:
        first = first_line(exc)
        raise UserError(f"could not load model '{source}' (offline, unknown hub name, or not a "
                        f"model folder): {first}; use a local folder or model.config.") from None


def load_tokenizer(cfg: Any) -> Any:
    """The recipe's tokenizer (`lctrain.data.load_tokenizer`), checked against the model's vocab."""
    from lctrain.data import load_tokenizer as load

    model = cfg.model
    config = resolve_config(model.path, model.config, trust_remote_code=model.trust_remote_code)
    return load(cfg, config.get_text_config().vocab_size)


def resolve_config(path: str | None, overrides: dict[str, Any] | None, *,
                   trust_remote_code: bool = False) -> Any:
    """The transformers config of model ``path`` (None: a random init from ``overrides``)
    with the recipe's ``overrides`` on top (UserError: no model, an unreadable or invalid one,
    or overrides that change the folder's model type or weights)."""
    fields = fold_rope_spellings(dict(overrides or {}), where="model.config")
    if path is None:
        return _random_init_config(fields)
    base, raw = _folder_config(require_model_path(path), path, trust_remote_code)
    if not fields:
        return base
    wanted = fields.get("model_type", raw.get("model_type"))
    if wanted != raw.get("model_type"):
        raise ConfigError(f"model.config.model_type is {wanted!r} but the model in {path} is a "
                          f"{raw.get('model_type')!r}; overrides on top of model.path cannot "
                          f"change the model type, so remove model.config.model_type",
                          key="model.config.model_type")
    merged = merge_overrides(raw, fields)
    config = _build(type(base), merged, where=f"model.config on top of {path}")
    folded = fold_rope_spellings(raw, where="the model's config.json", strict=False)
    structural = [k for k in sorted(merged)
                  if merged[k] != folded.get(k) and not _COMPUTE_ONLY.match(k)]
    if structural:
        _check_same_weights(base, config, structural, path)
    return config


def fold_rope_spellings(fields: dict[str, Any], *, where: str,
                        strict: bool = True) -> dict[str, Any]:
    """``fields`` with ``rope_theta`` / ``rope_scaling`` folded into ``rope_parameters``
    (``rope_scaling: null`` is ``rope_type: default``); where both spellings set a key,
    ``rope_parameters`` wins (``strict``: ConfigError when they disagree)."""
    fields = dict(fields)
    has_scaling, has_theta = "rope_scaling" in fields, "rope_theta" in fields
    if not (has_scaling or has_theta):
        return fields
    rope: dict[str, Any] = {}
    scaling = fields.pop("rope_scaling", None)
    if has_scaling:
        rope = {"rope_type": "default"} if scaling is None else dict(scaling)
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
    if has_theta:
        rope["rope_theta"] = fields.pop("rope_theta")
    given = fields.get("rope_parameters") or {}
    for key, value in rope.items():
        if strict and key in given and given[key] != value:
            raise ConfigError(f"{where} sets RoPE's {key} twice, as {given[key]!r} in "
                              f"rope_parameters and as {value!r} in the older rope_scaling / "
                              f"rope_theta spelling; keep rope_parameters only",
                              key="model.config.rope_parameters")
    fields["rope_parameters"] = {**rope, **given}
    return fields


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The folder's config fields with ``overrides`` on top, merged as the module docstring says."""
    merged = fold_rope_spellings(base, where="the model's config.json", strict=False)
    for key, value in fold_rope_spellings(overrides, where="model.config").items():
        merged[key] = (_merge_rope(merged.get(key) or {}, value)
                       if key == "rope_parameters" and isinstance(value, dict) else value)
    return merged


def _merge_rope(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    if base and all(isinstance(v, dict) for v in base.values()) and all(
            isinstance(v, dict) for v in override.values()):  # per layer type (Gemma 3 style)
        return {**base, **{k: _merge_rope(base.get(k, {}), v) for k, v in override.items()}}
    kind = override.get("rope_type", base.get("rope_type", "default"))
    if kind == base.get("rope_type", "default"):
        return {**base, **override}
    kept = {"rope_theta": base["rope_theta"]} if "rope_theta" in base else {}
    return {**kept, **override}


def _random_init_config(fields: dict[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise UserError("model.config needs a model_type (for example model_type: llama) to "
                        "build a randomly initialised model.")
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"model.config.model_type '{model_type}' is not a model type this "
                        "transformers knows; use one such as llama, mistral or qwen2.")
    return _build(CONFIG_MAPPING[model_type], fields, where=f"model.config ('{model_type}')")


def _folder_config(source: str, shown: str, trust: bool) -> tuple[Any, dict[str, Any]]:
    """(the folder's config as transformers reads it, its config.json fields as written)."""
    from transformers import AutoConfig

    only = cache_only(source)
    try:
        base = AutoConfig.from_pretrained(source, trust_remote_code=trust, local_files_only=only)
        raw, _ = type(base).get_config_dict(source, local_files_only=only)
    except (OSError, ValueError) as exc:
        raise UserError(f"could not read the config of model '{shown}' (offline, unknown hub "
                        f"name, or not a model folder): {first_line(exc)}; point model.path at a "
                        f"local folder holding config.json.") from None
    return base, dict(raw)


def _build(config_class: Any, fields: dict[str, Any], *, where: str) -> Any:
    try:
        from huggingface_hub.errors import StrictDataclassFieldValidationError
    except ImportError:  # a huggingface_hub without strict config fields
        StrictDataclassFieldValidationError = ()
    check_rope_type(fields.get("rope_parameters"))
    try:
        return config_class.from_dict(dict(fields))
    except StrictDataclassFieldValidationError as exc:  # a field of the wrong type
        name = re.search(r"field '([^']+)'", str(exc))
        name = name[1] if name else "?"
        why = first_line(exc.__cause__ or exc).split(". Errors:")[0]
        raise ConfigError(f"{where}: {name} is {fields.get(name)!r}, which transformers refuses "
                          f"({why}); fix or remove model.config.{name}",
                          key=f"model.config.{name}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{where} is not a valid config: {exc}") from None


def _check_same_weights(base: Any, config: Any, keys: list[str], path: str) -> None:
    """Raise ConfigError when ``config`` gives the model other weights than ``base``."""
    from transformers import AutoModelForCausalLM

    def shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        return {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: once

    before, after = shapes(base), shapes(config)
    if before == after:
        return
    differ = sorted(set(before) ^ set(after)) or sorted(n for n in before if before[n] != after[n])
    raise ConfigError(f"model.config overrides {', '.join(keys)} change the weights of the model "
                      f"in {path} (first difference: {differ[0]}); overrides on top of model.path "
                      f"may change RoPE, the context length, dropout or windows but not the "
                      f"architecture, so remove them (or set model.config=null)",
                      key="model.config")
