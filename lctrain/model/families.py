"""The model families lctrain knows beyond transformers' generic path, and their traits: the one
table that the model patches, the layer tiling and the memory model all read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What lctrain may do with one transformers ``model_type``."""

    prefix: str  # the class-name prefix of its modules (``LlamaRMSNorm``, ...)
    grouped: bool = True  # attention is q/k/v, RoPE, attention, o only: head groups can run it


FAMILIES = {
    "llama": Family("Llama"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3", grouped=False),  # per-head q/k norms inside its attention
}
"""model_type -> its traits; any other type runs transformers' own modules. Every family's
RMSNorm, RoPE and gated MLP can run as fused kernels, and its post-attention norm sits right
before the MLP (so it runs inside the MLP's tiles)."""


def family(model_type: str | None) -> Family | None:
    """The traits of ``model_type``, or None for a type outside the table."""
    return FAMILIES.get(model_type or "")


def class_names(suffix: str) -> frozenset[str]:
    """The module class names of the families ending in ``suffix`` (e.g. ``"MLP"``)."""
    return frozenset(f.prefix + suffix for f in FAMILIES.values())
