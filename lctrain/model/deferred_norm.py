"""A decoder layer's norm whose work moves into the module that reads its output.

When that module runs the norm itself (the MLP's tiles, `lctrain.parallel.tiling`; the grouped
attention block) it keeps the norm's input, a tensor the layer holds anyway, instead of its output,
and recomputes the norm in its backward; `DeferredNorm` stands in the norm's place, passes its input
through and keeps the parameters where they were (same names, state dicts and checkpoints)."""
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
