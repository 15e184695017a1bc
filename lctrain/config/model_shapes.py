"""The sizes of a transformers model config, checked before any process starts.

A recipe's ``model.config`` (a random init) and a model folder's ``config.json`` are plain
mappings until transformers builds the model inside each worker; a size of zero or heads that do
not divide would fail there with a traceback (a division by zero in the rotary embedding, a
ValueError in an attention layer). `check_model_shapes` says the same as one sentence, first.
"""
from __future__ import annotations

from lctrain.errors import ConfigError

MODEL_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
"""transformers config fields that are sizes: positive whole numbers when given."""


def check_model_shapes(config: dict, where: str) -> None:
    """Refuse a transformers config whose sizes cannot build a model (before any process
    starts): a size that is not a positive whole number, query heads not divisible by the
    key/value heads, or (without head_dim) a hidden size not divisible by the heads.

    Args:
        config: the config's fields (``model.config`` or a folder's config.json).
        where: how to name it, e.g. ``model.config`` or ``/models/x/config.json``.

    Raises:
        ConfigError: naming the field, its value and the rule.
    """
    fields = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for name in MODEL_SIZES:
        value = fields.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value <= 0):
            raise ConfigError(f"{where}: {name} is {value!r} but must be a positive whole "
                              "number", key=f"model.config.{name}")
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not divisible by "
                          f"num_key_value_heads {kv}; use a divisor of {heads}",
                          key="model.config.num_attention_heads")
    hidden = fields.get("hidden_size")
    if hidden and heads and fields.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size {hidden} is not divisible by "
                          f"num_attention_heads {heads} (the head width); choose heads that "
                          f"divide {hidden}, or set head_dim", key="model.config.num_attention_heads")
