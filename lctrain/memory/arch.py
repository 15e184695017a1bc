"""Decoder architectures as the memory model sees them: shapes only, from a transformers
config or a preset, with the Llama family's parameters counted in closed form."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lctrain.errors import UserError
from lctrain.model.families import family

_UNTIED_BY_DEFAULT = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "olmo", "olmo2", "phi3",
                      "granite", "starcoder2", "cohere"}
"""model_types whose config defaults to an untied head (others: tied, as transformers)."""

_SILU_NAMES = {"silu", "swish"}
"""``hidden_act`` values transformers maps to a SiLU."""

_QKV_BIAS = {"qwen2"}
"""model_types whose q/k/v projections always carry a bias (no config flag for it)."""


@dataclass(frozen=True, kw_only=True)
class Architecture:
    """A dense decoder's shapes, and which of lctrain's modules run (each keeping less)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    fused_norms: bool = False
    fused_mlp: bool = False
    fused_loss: bool = False
    grouped_attention: bool = False
    norm_in_tiles: bool = False
    norm_in_attention: bool = False

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise UserError(f"model {self.name}: {field} is {getattr(self, field)} but must be "
                                "positive")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"model {self.name}: {self.num_heads} attention heads are not divisible "
                            f"by {self.num_kv_heads} key/value heads")

    @property
    def q_width(self) -> int:
        """Hq·d, the width of the queries (and of the attention output)."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Hkv·d, the width of the keys (and of the values)."""
        return self.num_kv_heads * self.head_dim

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer."""
        h, inter = self.hidden_size, self.intermediate_size
        attn = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        attn += (self.q_width + 2 * self.kv_width) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * inter + (2 * inter + h) * self.mlp_bias
        return attn + mlp + 2 * h

    def embedding_parameters(self) -> int:
        """Input embedding plus output head (once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def parameters(self) -> int:
        """All parameters: embeddings, head, every layer and the final norm."""
        return (self.embedding_parameters() + self.num_layers * self.layer_parameters()
                + self.hidden_size)


def from_config_dict(config: dict[str, Any], *, name: str | None = None) -> Architecture:
    """An Architecture from transformers config fields (UserError: a size is missing)."""
    model_type = str(config.get("model_type", "unknown"))
    label = name or model_type
    cfg = config.get("text_config") or config  # multimodal configs keep the decoder apart
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if not isinstance(cfg.get(k), int)]
    if missing:
        raise UserError(f"model {label}: the config has no {', '.join(missing)}; the memory model "
                        "needs a dense decoder config (vocab_size, hidden_size, intermediate_size, "
                        "num_hidden_layers, num_attention_heads)")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    tied = config.get("tie_word_embeddings", model_type not in _UNTIED_BY_DEFAULT)
    attention_bias = bool(cfg.get("attention_bias", False))
    fam = family(model_type)
    return Architecture(
        name=label, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, tied_embeddings=bool(tied),
        qkv_bias=attention_bias or model_type in _QKV_BIAS, o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)), fused_norms=fam is not None,
        fused_mlp=fam is not None and cfg.get("hidden_act", "silu") in _SILU_NAMES,
        fused_loss=True, grouped_attention=bool(fam and fam.grouped),
        norm_in_tiles=fam is not None, norm_in_attention=bool(fam and fam.grouped))


def load_architecture(model: str) -> Architecture:
    """A preset, a ``config.json`` or a model folder, else a hub name through transformers
    (UserError: none of those)."""
    from lctrain.config.paths import read_model_config
    from lctrain.memory.presets import PRESETS

    if model in PRESETS:
        return from_config_dict(PRESETS[model], name=model)
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model).to_dict()
        except (OSError, ValueError) as exc:
            raise UserError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                            f"config.json or a model folder, and the hub did not give its config "
                            f"({exc.__class__.__name__}: offline or an unknown name); pass one of "
                            "those") from None
        return from_config_dict(config, name=model)
    folder = os.path.isdir(path)
    if folder:
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise UserError(f"model {model!r} is a folder without a config.json; point it at a "
                            "model folder (config.json, weights, tokenizer) or a config.json file")
    fix = "the model folder is damaged" if folder else "fix the file"
    config = read_model_config(path, fix=fix, key=None)
    if not isinstance(config, dict):
        raise UserError(f"the model config {path} is not a JSON object; {fix}")
    return from_config_dict(config, name=model)
