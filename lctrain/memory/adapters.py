"""LoRA in the memory model: only adapters and fully trained copies have gradients and AdamW
states, and frozen weights keep fewer activations (a tensor is kept only for the gradients
autograd computes). Only the Llama family's module names are known."""
from __future__ import annotations

from dataclasses import dataclass

from lctrain.config.schema import LORA_ALL_LINEAR, LoraConfig
from lctrain.errors import UserError
from lctrain.memory.arch import Architecture

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama-family decoder layer, as lora.target_modules names them."""
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
ROOT_MODULES = ("embed_tokens", "norm")
MASK_BYTES = 1
"""Bytes per element of a dropout mask on a GPU (a boolean)."""


@dataclass(frozen=True)
class LoraShape:
    """A recipe's lora section in the memory model's terms."""

    rank: int
    targets: frozenset[str]
    trainable: frozenset[str]
    dropout: bool


def lora_shape(lora: LoraConfig) -> LoraShape | None:
    """The memory model's view of ``lora`` (None when off; UserError: an unknown module name)."""
    if not lora.enabled:
        return None
    targets = (PROJECTIONS if tuple(lora.target_modules) == (LORA_ALL_LINEAR,)
               else lora.target_modules)
    known = PROJECTIONS + LAYER_NORMS + ROOT_MODULES
    for key, names, allowed in (("target_modules", targets, PROJECTIONS),
                                ("trainable_modules", lora.trainable_modules, known)):
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise UserError(f"lora.{key} names {unknown[0]}, which the memory model does not "
                            f"know; it knows the Llama family's {', '.join(allowed)}")
    return LoraShape(rank=lora.rank, targets=frozenset(targets),
                     trainable=frozenset(lora.trainable_modules), dropout=lora.dropout > 0)


def projection_shapes(arch: Architecture) -> dict[str, tuple[int, int, bool]]:
    """(in, out, has bias) of each projection of one layer."""
    h, q, kv, inter = arch.hidden_size, arch.q_width, arch.kv_width, arch.intermediate_size
    return {"q_proj": (h, q, arch.qkv_bias), "k_proj": (h, kv, arch.qkv_bias),
            "v_proj": (h, kv, arch.qkv_bias), "o_proj": (q, h, arch.o_bias),
            "gate_proj": (h, inter, arch.mlp_bias), "up_proj": (h, inter, arch.mlp_bias),
            "down_proj": (inter, h, arch.mlp_bias)}


def layer_trainable(arch: Architecture, lora: LoraShape) -> int:
    """Trainable parameters of one decoder layer: adapters plus fully trained copies."""
    shapes = projection_shapes(arch)
    adapters = sum(lora.rank * (shapes[n][0] + shapes[n][1]) for n in lora.targets)
    copies = sum(i * o + o * bias for n, (i, o, bias) in shapes.items() if n in lora.trainable)
    copies += arch.hidden_size * sum(n in lora.trainable for n in LAYER_NORMS)
    return adapters + copies


def root_trainable(arch: Architecture, lora: LoraShape) -> int:
    """Trainable parameters outside the layers: copies of the embeddings and the final norm."""
    embed = arch.vocab_size * arch.hidden_size if "embed_tokens" in lora.trainable else 0
    return embed + (arch.hidden_size if "norm" in lora.trainable else 0)


def trainable_parameters(arch: Architecture, lora: LoraShape | None) -> int:
    """Parameters with gradients and AdamW states: all without LoRA; with it, the adapters and
    fully trained copies (they come on top of the frozen base model)."""
    if lora is None:
        return arch.parameters()
    return arch.num_layers * layer_trainable(arch, lora) + root_trainable(arch, lora)


def _keeps_input(lora: LoraShape, consumers: tuple[str, ...]) -> bool:
    """Whether any of ``consumers`` keeps its input: a trained copy, or an adapter without
    dropout (with dropout, the adapter keeps its dropped-out input instead)."""
    return any(n in lora.trainable or (n in lora.targets and not lora.dropout) for n in consumers)


def _attention_and_adapters(arch: Architecture, t: int, c: int, lora: LoraShape,
                            targets, mask_bytes: int) -> int:
    """q, k, v, the attention output and its lse, and what the adapters on ``targets`` keep."""
    shapes = projection_shapes(arch)
    attention = c * t * (2 * arch.q_width + 2 * arch.kv_width) + 4 * t * arch.num_heads
    return attention + sum(c * t * lora.rank + lora.dropout * (c + mask_bytes) * t * shapes[n][0]
                           for n in targets)


def layer_saved(arch: Architecture, tokens: int, c: int, lora: LoraShape,
                mask_bytes: int = MASK_BYTES) -> int:
    """Bytes one decoder layer keeps for its backward in a LoRA run (no checkpointing)."""
    t, h = tokens, arch.hidden_size
    kept_input = c if arch.fused_norms else 4  # fused: the input; else its fp32 upcast
    norms = 2 * (kept_input * t * h + 4 * t)  # and the scale: the input gradient needs them
    for norm, consumers in zip(LAYER_NORMS, (PROJECTIONS[:3], PROJECTIONS[4:6])):
        normalised = norm in lora.trainable and not arch.fused_norms  # fused: recomputed
        norms += c * t * h * (normalised + _keeps_input(lora, consumers))
    kept_mlp = (2 if arch.fused_mlp else 3) + _keeps_input(lora, ("down_proj",))
    mlp = kept_mlp * c * t * arch.intermediate_size
    return norms + mlp + _attention_and_adapters(arch, t, c, lora, lora.targets, mask_bytes)


def tiled_layer_saved(arch: Architecture, tokens: int, c: int, lora: LoraShape,
                      mask_bytes: int = MASK_BYTES) -> int:
    """`layer_saved` of a LoRA run in tiles."""
    t, h = tokens, arch.hidden_size
    targets = [n for n in lora.targets if n in PROJECTIONS[:4]]  # (the MLP's run in tiles)
    inputs = (2 if arch.norm_in_tiles else 3) * c * t * h  # x, h1 (and the second norm's output)
    return (inputs + c * t * h * _keeps_input(lora, PROJECTIONS[:3])
            + _attention_and_adapters(arch, t, c, lora, targets, mask_bytes))
