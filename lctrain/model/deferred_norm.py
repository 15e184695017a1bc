"""A decoder layer's norm whose work moves into the module that reads its output.

In a Llama-family layer each RMSNorm's output is a (tokens × hidden) tensor that exists only to
feed the next module (the attention block, or the MLP), and that module keeps it for its
backward. When the next module runs the norm itself — the MLP's tiles
(`lctrain.parallel.tiling`), or the attention block whose projections run in head groups
(`lctrain.model.grouped_attention`) — it keeps the norm's input instead, a tensor the layer
holds anyway, and recomputes the norm in its backward. The norm then has nothing left to do in
the layer's own forward: `DeferredNorm` stands in its place and passes its input through.

Its parameters stay where they were (``input_layernorm.weight`` reads the same in names, state
dicts and distributed checkpoints; it is a torch ``ActivationWrapper``), and FSDP2 and optimizers
see the same tensors; the consuming module passes them through its own backward.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper


class DeferredNorm(ActivationWrapper):
    """Holds a norm that the next module applies; its own forward returns the input as it is."""

    @property
    def norm(self) -> nn.Module:
        """The norm module, for the module that applies it."""
        return self._checkpoint_wrapped_module

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def bare(module: nn.Module) -> nn.Module:
    """``module`` without any wrapper of torch's ``ActivationWrapper`` kind around it (tiles,
    deferral, checkpointing)."""
    while isinstance(module, ActivationWrapper):
        module = module._checkpoint_wrapped_module
    return module
