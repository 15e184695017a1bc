"""The model families lctrain knows beyond transformers' generic path, and their traits: the one
table that the model patches, the layer tiling and the memory model all read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What lctrain may do with one transformers ``model_type``.

    Attributes:
        prefix: the class-name prefix of its modules (``LlamaRMSNorm``, ``LlamaMLP``, ...).
        fused: its RMSNorm, RoPE (transformers' Llama formula) and gated MLP can run as
            lctrain_kernels' fused kernels.
        grouped: its attention module is q/k/v projections, RoPE, the attention and an output
            projection, nothing else, so its projections can run inside head groups.
        norm_before_mlp: its layer runs ``post_attention_layernorm`` right before the MLP, so
            the norm can run inside the MLP's tiles.
    """

    prefix: str
    fused: bool = True
    grouped: bool = True
    norm_before_mlp: bool = True


FAMILIES = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3", grouped=False),  # per-head q/k norms inside its attention
}
"""model_type -> its traits; any other type runs transformers' own modules."""


def family(model_type: str | None) -> Family | None:
    """The traits of ``model_type``, or None for a type outside the table."""
    return FAMILIES.get(model_type or "")


def class_names(suffix: str) -> frozenset[str]:
    """The module class names of the fused families ending in ``suffix`` (e.g. ``"MLP"``)."""
    return frozenset(f.prefix + suffix for f in FAMILIES.values() if f.fused)
