"""The transformers config a run trains: a model folder's config.json with the recipe's
``model.config`` overrides on top, or — for a random init — the recipe's config alone.

Overrides exist for context extension: a recipe that trains a model pretrained at 8K tokens at
128K sets RoPE scaling and ``max_position_embeddings`` without editing the folder, and the model
built from the result carries them in its ``config`` (what a saved or exported model writes, so
that it extends the same way when loaded elsewhere).

RoPE spellings. transformers 5 keeps every RoPE setting in one mapping, ``rope_parameters =
{rope_type, rope_theta, factor, original_max_position_embeddings, ...}``. Older configs and
recipes write ``rope_theta: X`` and ``rope_scaling: {type or rope_type: ..., factor: ...}``
instead. Both spellings are accepted, in the folder and in the overrides, and folded into
``rope_parameters`` first (transformers itself ignores a ``rope_theta`` given beside
``rope_parameters`` without a word).

Merging. An override of ``rope_parameters`` is merged key by key into the folder's while it keeps
the folder's ``rope_type`` (so ``rope_parameters.rope_theta=1e6`` changes the base alone); one
that names another ``rope_type`` replaces the folder's mapping and keeps only its ``rope_theta``
(the other keys belong to the old type). Any other key replaces the folder's value, on the
folder's config.json as written (before transformers derives fields such as Qwen2's
``layer_types`` from it, so that ``use_sliding_window`` and friends act as they would there).

Shapes. Overrides may change how the model computes (RoPE, context length, dropout, windows) but
not which weights it has: when an override changes anything else, the models of both configs are
built on the meta device (no memory, no weights) and their parameter shapes compared.
"""
from __future__ import annotations

import re
from typing import Any

from lctrain.config import require_model_path
from lctrain.config.hub import cache_only
from lctrain.errors import ConfigError, UserError

_COMPUTE_ONLY = re.compile(r"^(rope_parameters|max_position_embeddings|sliding_window|"
                           r"use_sliding_window|max_window_layers|layer_types|use_cache|"
                           r"(bos|eos|pad)_token_id|.*(dropout|pdrop|softcap).*)$")
"""Config keys whose change leaves the weights as they are (no meta-model comparison needed)."""


def resolve_config(path: str | None, overrides: dict[str, Any] | None, *,
                   trust_remote_code: bool = False) -> Any:
    """The transformers config to build or load the model with.

    Args:
        path: model folder or hub name (None: random init from ``overrides``).
        overrides: the recipe's ``model.config`` (a whole config with ``model_type`` when
            ``path`` is None; else changes to the folder's config).
        trust_remote_code: allow a config class shipped with the model.

    Returns:
        A transformers ``PreTrainedConfig``.

    Raises:
        UserError: no model, a placeholder path, an unreadable folder, an unknown model type,
            an invalid config, or overrides that change the folder's model type or weights.
    """
    fields = fold_rope_spellings(dict(overrides or {}), where="model.config")
    if path is None:
        return _random_init_config(fields)
    source = require_model_path(path)
    base, raw = _folder_config(source, path, trust_remote_code)
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
    changed = sorted(k for k in merged if merged[k] != folded.get(k))
    structural = [k for k in changed if not _COMPUTE_ONLY.match(k)]
    if structural:
        _check_same_weights(base, config, structural, path)
    return config


def fold_rope_spellings(fields: dict[str, Any], *, where: str,
                        strict: bool = True) -> dict[str, Any]:
    """``fields`` with ``rope_theta`` / ``rope_scaling`` folded into ``rope_parameters``.

    ``rope_scaling: null`` means unscaled RoPE (``rope_type: default``); a ``type`` key becomes
    ``rope_type``. Where both spellings set one key, ``rope_parameters`` wins (as transformers
    reads a config.json), unless ``strict``.

    Raises:
        ConfigError: ``strict`` and two spellings give one setting different values.
    """
    fields = dict(fields)
    has_scaling, has_theta = "rope_scaling" in fields, "rope_theta" in fields
    if not (has_scaling or has_theta):
        return fields
    rope: dict[str, Any] = {}
    scaling = fields.pop("rope_scaling", None)
    if has_scaling:
        rope = {"rope_type": "default"} if scaling is None else dict(scaling)
        if "type" in rope:
            kind = rope.pop("type")
            rope.setdefault("rope_type", kind)
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
    """The folder's config fields with ``overrides`` on top (either in either RoPE spelling).

    Returns:
        A new mapping, RoPE in ``rope_parameters``, merged as the module docstring says.
    """
    merged = fold_rope_spellings(base, where="the model's config.json", strict=False)
    for key, value in fold_rope_spellings(overrides, where="model.config").items():
        if key == "rope_parameters" and isinstance(value, dict):
            merged[key] = _merge_rope(merged.get(key) or {}, value)
        else:
            merged[key] = value
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
    """(the folder's config as transformers reads it, its config.json fields as written).

    A hub name is read from the local hub cache alone when the hub cannot be asked
    (`lctrain.config.hub.cache_only`)."""
    from transformers import AutoConfig

    only = cache_only(source)
    try:
        base = AutoConfig.from_pretrained(source, trust_remote_code=trust, local_files_only=only)
        raw, _ = type(base).get_config_dict(source, local_files_only=only)
    except (OSError, ValueError) as exc:
        first = first_line(exc)
        raise UserError(f"Could not read the config of model '{shown}' (offline, unknown hub "
                        f"name, or not a model folder): {first}; point model.path at a local "
                        f"folder holding config.json.") from None
    return base, dict(raw)


def _build(config_class: Any, fields: dict[str, Any], *, where: str) -> Any:
    try:
        return config_class.from_dict(dict(fields))
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{where} is not a valid config: {exc}") from None


def _check_same_weights(base: Any, config: Any, keys: list[str], path: str) -> None:
    """Raise ConfigError when ``config`` gives the model other weights than ``base``."""
    import torch
    from transformers import AutoModelForCausalLM

    def shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        return {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: once

    before, after = shapes(base), shapes(config)
    if before == after:
        return
    differ = sorted(set(before) ^ set(after)) or sorted(
        n for n in before if before[n] != after[n])
    raise ConfigError(f"model.config overrides {', '.join(keys)} change the weights of the model "
                      f"in {path} (first difference: {differ[0]}); overrides on top of model.path "
                      f"may change RoPE, the context length, dropout or windows but not the "
                      f"architecture, so remove them (or set model.config=null)",
                      key="model.config")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message without its final period (to quote inside a
    sentence), or the exception's type name when it has no message."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__
