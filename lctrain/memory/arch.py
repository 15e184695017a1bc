"""Decoder architectures as the memory model sees them: shapes only, no weights.

An :class:`Architecture` is read from a transformers ``config.json`` (a file, a model folder, a
recipe's ``model.config`` mapping) or taken from a built-in preset, and counts its parameters in
closed form for the Llama family of dense decoders (Llama, Mistral, Qwen2, ...):

    embeddings   V·h                       (+ V·h for an untied output head)
    per layer    attention  h·(Hq·d) + 2·h·(Hkv·d) + (Hq·d)·h   (q, k, v with GQA, o)
                            + biases: Hq·d + 2·Hkv·d for q/k/v bias (Qwen2), + h for o
                 MLP        3·h·I  (gate, up, down; + 2·I + h with mlp_bias)
                 norms      2·h    (RMSNorm weights before attention and MLP)
    final norm   h

Llama-7B (V 32000, h 4096, I 11008, 32 layers, 32 heads, untied) gives 6 738 415 616.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lctrain.errors import UserError
from lctrain.model.families import family

_UNTIED_BY_DEFAULT = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "olmo", "olmo2", "phi3",
                      "granite", "starcoder2", "cohere"}
"""model_types whose transformers config defaults to an untied output head; any other type
follows transformers' generic default (tied) when ``tie_word_embeddings`` is absent."""

_SILU_NAMES = {"silu", "swish"}
"""``hidden_act`` values transformers maps to a SiLU."""

_QKV_BIAS = {"qwen2"}
"""model_types whose q/k/v projections always carry a bias (no config flag for it)."""



@dataclass(frozen=True, kw_only=True)
class Architecture:
    """The shapes of a dense decoder-only transformer.

    Attributes:
        name: a label for reports (preset name, folder or model_type).
        vocab_size: V, rows of the embedding and of the output head.
        hidden_size: h, width of the residual stream.
        intermediate_size: I, width of the gated MLP.
        num_layers: decoder layers.
        num_heads: query heads Hq.
        num_kv_heads: key/value heads Hkv (GQA when < Hq).
        head_dim: d (h / Hq unless the config says otherwise).
        tied_embeddings: the output head shares the embedding matrix.
        qkv_bias: q, k and v projections have biases.
        o_bias: the attention output projection has a bias.
        mlp_bias: the MLP projections have biases.
        fused_norms: the RMSNorms run fused (`lctrain.model.rms_norm`): each keeps its input
            and one float32 scale per token for the backward, not a float32 copy of its input.
        fused_mlp: the MLP's SiLU product runs fused (`lctrain.model.swiglu`): it keeps the gate
            and up projections for the backward, not the SiLU's output as well.
        fused_loss: the chunked loss runs its kernel (`lctrain.train.loss_kernel`): no float32
            copy of a chunk's logits, and no head-gradient product in the compute dtype.
        grouped_attention: with head groups, the attention's projections and RoPE run in the
            groups too (`lctrain.model.grouped_attention`): no q, k, v kept, no full-size dq,
            dk, dv.
        norm_in_tiles: in tiled layers the norm before the MLP runs inside the MLP's tiles
            (`lctrain.parallel.tiling`): its output is not kept.
        norm_in_attention: where the attention's projections run in head groups, the norm
            before the attention runs inside that block too: its output is not kept.
    """

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
    """Build an Architecture from transformers config fields (a ``config.json`` mapping).

    Raises:
        UserError: a required field (vocab_size, hidden_size, intermediate_size,
            num_hidden_layers, num_attention_heads) is missing.
    """
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
        mlp_bias=bool(cfg.get("mlp_bias", False)), fused_norms=bool(fam and fam.fused),
        fused_mlp=bool(fam and fam.fused) and cfg.get("hidden_act", "silu") in _SILU_NAMES,
        fused_loss=True, grouped_attention=bool(fam and fam.grouped),
        norm_in_tiles=bool(fam and fam.norm_before_mlp),
        norm_in_attention=bool(fam and fam.grouped))


def load_architecture(model: str) -> Architecture:
    """A preset name (``llama-7b``, ...), a ``config.json`` file or a model folder holding one.

    A damaged config.json is reported as `check_model_path` reports it for finetune (the file,
    the line of a JSON error, the folder damaged), by the same reader.

    Raises:
        UserError: neither a preset nor an existing path; a folder without config.json; a
            config.json that cannot be read, is not JSON or not a JSON object.
    """
    from lctrain.config.paths import read_model_config
    from lctrain.memory.presets import PRESETS

    if model in PRESETS:
        return from_config_dict(PRESETS[model], name=model)
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise UserError(f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor "
                        "a config.json file or a folder holding one")
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
