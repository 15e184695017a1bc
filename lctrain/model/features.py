"""What lctrain can train exactly, checked on a model's config before any weight loads.

lctrain's attention is exact causal (document-masked) attention and its loss reads the output head
directly, so a model that asks for more — a window shorter than the sequence, soft-capped or scaled
logits, ALiBi, sinks, bidirectional attention, attention dropout, an auxiliary router loss — is
refused in one sentence naming the setting as its config.json does; `check_attention_call` checks
each call again. A RoPE model trains past ``max_position_embeddings`` with a warning; RoPE types
whose frequencies follow each call's longest position are refused there under cp > 1."""
from __future__ import annotations

import math
import re
from typing import Any, Iterator

from lctrain.errors import ConfigError

_ATTENTION_DROPOUT = re.compile(r"(att|attn|attention).*(drop)|drop.*(att|attn)")
# layer_types lctrain trains (sliding ones while the window covers the row; the last three: MLPs)
_TRAINABLE_LAYERS = {"full_attention", "sliding_attention", "dense", "sparse", "moe"}
_LOGIT_SCALES = ("logit_scale", "logits_scaling")  # Cohere, Granite
# transformers model types whose decoder layers call their attention without the call's keywords
_KEYWORDS_DROPPED = {"nemotron"}


def check_model_config(config: Any, *, seq_len: int | None = None, cp: int = 1) -> list[str]:
    """Refuse what lctrain cannot train exactly at ``seq_len`` (None: no length checks) over
    ``cp`` ranks (a ConfigError naming the setting, its value and the fix); return warnings,
    one sentence each."""
    _check_architecture(config)
    _check_names(config)
    for key, value in _items(config.to_dict()):
        _check_setting(key, value)
    _check_windows(config, seq_len)
    return _check_positions(config, seq_len, cp) if seq_len else []


def check_attention_call(module: Any, head_dims: tuple[int, int], attention_mask: Any,
                         dropout: float, kwargs: dict[str, Any], global_len: int) -> None:
    """Raise ConfigError when one attention call of ``module`` (``head_dims``: of its queries
    and values, ``kwargs`` its other keywords, ``global_len`` tokens in all) asks for more than
    exact causal attention."""
    config = getattr(module, "config", None)
    if dropout:
        key = _key_with_value(config, _ATTENTION_DROPOUT, dropout)
        fix = f"set model.config.{key}=0" if key else "set the model's attention dropout to 0"
        raise ConfigError(f"the model's {key or 'attention dropout'} is {dropout} (dropout on the "
                          f"attention weights), which lctrain's attention cannot apply; {fix}")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window and window < global_len:
        raise ConfigError(_window_message(window, global_len))
    softcap = kwargs.get("softcap")
    if softcap:
        key = _key_with_value(config, re.compile("softcap"), softcap) or "softcap"
        raise ConfigError(f"the model's {key} is {softcap} (soft-capping of the attention "
                          f"scores), which lctrain's attention cannot apply")
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ConfigError(f"{type(module).__name__} passes {name} to its attention (sinks or "
                              f"a position bias), which lctrain's attention cannot apply")
    if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        raise ConfigError(f"lctrain attention is causal only, but {type(module).__name__} asks "
                          f"for bidirectional attention")
    if attention_mask is not None:
        raise ConfigError("lctrain attention builds its own causal/document mask; pass document "
                          "boundaries as cp_context.cu_seqlens, not an attention_mask")
    if head_dims[0] != head_dims[1]:
        raise ConfigError(f"{type(module).__name__} has values of head size {head_dims[1]} "
                          f"but queries of {head_dims[0]}; lctrain's kernels need one size")


def _check_architecture(config: Any) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"model_type {model_type} is an encoder-decoder model; lctrain "
                          f"fine-tunes decoder-only causal language models")
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
            return  # the model's own code: the attention call is checked when it runs
        raise ConfigError(f"model_type {model_type} has no causal language model class in "
                          f"transformers; lctrain fine-tunes decoder-only causal LMs such as "
                          f"Llama, Mistral and Qwen") from None
    if model_type in _KEYWORDS_DROPPED:
        raise ConfigError(f"{cls.__name__} (model_type {model_type}) does not pass the call's "
                          f"keywords from its decoder layers to its attention, which would then "
                          f"miss the document bounds and the cp group; use a model such as "
                          f"Llama, Mistral or Qwen")
    if not getattr(cls, "_supports_attention_backend", False):
        raise ConfigError(f"{cls.__name__} (model_type {model_type}) does not call its attention "
                          f"through transformers' attention interface, so lctrain cannot run its "
                          f"own attention in it; use a model such as Llama, Mistral or Qwen")


def _check_names(config: Any) -> None:
    """The activation is one transformers builds (a model with its own code: its own)."""
    from transformers.activations import ACT2FN

    if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return
    for key in ("hidden_act", "hidden_activation"):
        act = getattr(config, key, None)
        if isinstance(act, str) and act not in ACT2FN:
            raise ConfigError(f"the model's {key} is {act!r}, which transformers does not know; "
                              f"use one of {', '.join(ACT2FN)}", key=f"model.config.{key}")


def check_rope_type(rope: Any) -> None:
    """ConfigError when ``rope_parameters`` names a RoPE type transformers does not build
    (checked before transformers reads the config, which only logs a warning)."""
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:  # a transformers that keeps them elsewhere: it checks them itself
        return
    if not isinstance(rope, dict):
        return
    nested = rope and all(isinstance(v, dict) for v in rope.values())  # per layer type
    for params in (rope.values() if nested else [rope]):
        kind = params.get("rope_type", "default")
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise ConfigError(f"model.config.rope_parameters.rope_type is {kind!r}, which "
                              f"transformers does not know; use default or one of "
                              f"{', '.join(ROPE_INIT_FUNCTIONS)}", key="model.config.rope_parameters")


def _check_setting(key: str, value: Any) -> None:
    """One config setting (dotted key for nested mappings) against what lctrain can train."""
    leaf = key.rsplit(".", 1)[-1]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if _ATTENTION_DROPOUT.search(leaf) and number and value > 0:
        raise ConfigError(f"the model's {key} is {value} (dropout on the attention weights), "
                          f"which lctrain's attention cannot apply; set model.config.{key}=0 to "
                          f"train without it")
    if "softcap" in leaf and number and value:
        what = ("the output logits, which lctrain's loss" if "final" in leaf
                else "the attention scores, which lctrain's attention")
        raise ConfigError(f"the model's {key} is {value} (soft-capping of {what} cannot apply); "
                          f"lctrain cannot fine-tune this model exactly")
    if leaf in _LOGIT_SCALES and number and value != 1:
        raise ConfigError(f"the model's {key} is {value} (a scale on the output logits, which "
                          f"lctrain's loss reads straight from the output head); lctrain cannot "
                          f"fine-tune this model exactly")
    if (leaf == "alibi" and value is True) or (leaf == "position_embedding_type"
                                               and value == "alibi"):
        raise ConfigError(f"the model's {key} selects ALiBi position biases, which lctrain's "
                          f"attention cannot apply; use a RoPE model")
    if (leaf == "is_causal" and value is False) or (leaf == "use_bidirectional_attention"
                                                    and value is True):
        raise ConfigError(f"the model's {key} is {value} (bidirectional attention), but lctrain's "
                          f"attention is causal only; set model.config.{key}="
                          f"{'true' if leaf == 'is_causal' else 'false'}")
    if leaf == "output_router_logits" and value is True:
        raise ConfigError(f"the model's {key} is True (an auxiliary router load-balancing loss), "
                          f"which lctrain's loss does not add; set model.config.{key}=false to "
                          f"train without it")
    if leaf == "attention_chunk_size" and value:
        raise ConfigError(f"the model's {key} is {value} (attention in chunks of {value} "
                          f"tokens), which lctrain's attention cannot apply")


def _check_windows(config: Any, seq_len: int | None) -> None:
    kinds = set(getattr(config, "layer_types", None) or [])
    other = sorted(kinds - _TRAINABLE_LAYERS)
    if other:
        raise ConfigError(f"the model's layer_types include {', '.join(other)}, which lctrain's "
                          f"attention cannot compute; it trains full_attention layers (and "
                          f"sliding_attention ones whose window covers data.seq_len)")
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or not window or (
            kinds and "sliding_attention" not in kinds):
        return
    if seq_len is not None and window < seq_len:
        raise ConfigError(_window_message(window, seq_len), key="model.config.sliding_window")


def _window_message(window: int, length: int) -> str:
    return (f"the model's sliding_window is {window} tokens, shorter than the {length}-token "
            f"sequence (data.seq_len), but lctrain's attention is full causal; set data.seq_len "
            f"to at most {window}, or model.config.sliding_window=null to train with full "
            f"attention instead (a different model than it was pretrained as)")


def _check_positions(config: Any, seq_len: int, cp: int) -> list[str]:
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None)
    name = (getattr(config, "attribute_map", None) or {}).get(  # GPT-2 says n_positions
        "max_position_embeddings", "max_position_embeddings")
    if not limit or seq_len <= limit:
        return []
    if not rope:
        raise ConfigError(f"data.seq_len {seq_len} is past the {limit} positions the model "
                          f"learned ({name} in its config.json), and learned position "
                          f"embeddings cannot be extended; set data.seq_len to at most {limit}",
                          key="data.seq_len")
    flat = rope if "rope_type" in rope or "rope_theta" in rope else next(iter(rope.values()))
    kind = flat.get("rope_type", "default")
    if cp > 1 and kind in ("dynamic", "longrope"):
        raise ConfigError(_per_call_rope_message(config, flat, kind, seq_len, limit, cp),
                          key="model.config.rope_parameters")
    if kind == "default":
        factor = 2 ** math.ceil(math.log2(seq_len / limit))
        return [f"data.seq_len {seq_len} is past the model's {name} {limit} and its RoPE is not "
                f"scaled (rope_type default, rope_theta {flat.get('rope_theta')}); to extend the "
                f"context set model.config.rope_parameters, e.g. {{rope_type: yarn, factor: "
                f"{factor}.0, original_max_position_embeddings: {limit}}}, and "
                f"model.config.{name}={seq_len}"]
    return [f"data.seq_len {seq_len} is past the model's {name} {limit} (RoPE {kind}); set "
            f"model.config.{name}={seq_len} so that the saved config declares the length it "
            f"was trained at"]


def _per_call_rope_message(config: Any, rope: dict, kind: str, seq_len: int, limit: int,
                           cp: int) -> str:
    text = (f"rope_type {kind} picks RoPE frequencies from the longest position of each forward "
            f"call, which differs between the {cp} ranks that share a sequence past the native "
            f"{limit} tokens; train with parallel.cp=1, or with rope_type yarn, linear or llama3")
    if kind != "dynamic" or "factor" not in rope:
        return text
    heads = config.num_attention_heads
    dim = int((getattr(config, "head_dim", None) or config.hidden_size // heads)
              * rope.get("partial_rotary_factor", 1.0))
    factor, theta = rope["factor"], rope.get("rope_theta", 10000.0)
    fixed = theta * ((factor * seq_len / limit) - (factor - 1)) ** (dim / (dim - 2))
    return (f"{text}, or with the frequencies dynamic gives at {seq_len} tokens on every rank: "
            f"model.config.rope_parameters={{rope_type: default, rope_theta: {fixed:.6g}}}")


def _items(mapping: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every setting, nested ones included, RoPE excluded."""
    for key, value in mapping.items():
        if key == "rope_parameters":
            continue
        if isinstance(value, dict):
            yield from _items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _key_with_value(config: Any, pattern: re.Pattern, value: Any) -> str | None:
    """The config key matching ``pattern`` that holds ``value``."""
    items = _items(config.to_dict()) if config is not None else ()
    return next((key for key, held in items
                 if pattern.search(key.rsplit(".", 1)[-1]) and held == value), None)
