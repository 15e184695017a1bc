"""Paired layers (layer policy ``full-paired``): the upper layer of a pair keeps no input.

Full checkpointing keeps each layer's input for its backward. In a pair of full layers the
upper layer's input is the lower layer's output, so it can be made again from what the lower
layer keeps anyway: when the backward reaches the upper layer, the lower layer's forward runs
once more (no gradients, the same autocast) from its kept input and the same arguments, and its
output becomes the upper layer's input for the recompute. One layer forward per pair buys one
layer input (tokens × hidden in the compute dtype) of memory — what a long sequence runs out of
when neither the GPU nor the host can hold every layer's input.

Mechanics: the lower layer's checkpointed call records its arguments (references to tensors
the step holds anyway: the lower layer's input, kept by its own checkpoint, and the position
embeddings and masks every layer shares). The upper layer's call runs inside
``saved_tensors_hooks`` whose pack hook stores a marker instead of the hidden-state input that
non-reentrant checkpointing saves, so nothing else holds that tensor and it is freed after the
forward; the unpack hook rebuilds it. The arguments are dropped once used, so nothing stays
alive into the next step. Under FSDP2 the lower layer's parameters are gathered first
(``FSDPModule.unshard``: a no-op when the backward's prefetch has gathered them already) and
stay gathered for its own backward, which comes next.

Exact: the rebuilt input is the same computation on the same values as the forward's (the
models lctrain trains have no dropout), so losses and gradients equal those of plain full
checkpointing (tested on the CPU, also under FSDP2 on two ranks).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lctrain.model.structure import unwrap_layer


class _Rebuild:
    """What the upper layer's checkpoint saves instead of its hidden-state input."""

    __slots__ = ("link",)

    def __init__(self, link: PairLink) -> None:
        self.link = link


class PairLink:
    """Joins the lower layer of a pair (``lower``: the module in the model's layer list, which
    FSDP2 turns into an ``FSDPModule`` in place) to the upper one."""

    def __init__(self, lower: nn.Module | None = None) -> None:
        self.lower = lower
        self._call = None  # (args, kwargs, device type, autocast dtype or None) of the forward

    def lower_checkpoint(self, context_fn, module: nn.Module, *args, **kwargs):
        """``checkpoint_fn`` of the lower layer: full checkpointing that also records the
        call's arguments (only in a forward that builds a graph)."""
        if torch.is_grad_enabled():
            hidden = _hidden(args, kwargs)
            kind = hidden.device.type
            dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
            self._call = (args, kwargs, kind, dtype)
        return checkpoint(module, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    def upper_checkpoint(self, context_fn, module: nn.Module, *args, **kwargs):
        """``checkpoint_fn`` of the upper layer: full checkpointing whose saved hidden-state
        input is rebuilt from the lower layer in the backward."""
        if not torch.is_grad_enabled():
            return checkpoint(module, *args, use_reentrant=False, context_fn=context_fn,
                              **kwargs)
        hidden = _hidden(args, kwargs)
        key = (hidden.data_ptr(), hidden.shape, hidden.dtype)
        del hidden
        marker = _Rebuild(self)

        def pack(tensor: torch.Tensor):
            return marker if (tensor.data_ptr(), tensor.shape, tensor.dtype) == key else tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            return checkpoint(module, *args, use_reentrant=False, context_fn=context_fn,
                              **kwargs)

    def rebuild(self) -> torch.Tensor:
        """The lower layer's output, computed again from its recorded call (once per forward)."""
        if self._call is None:
            raise RuntimeError("the input of a full-paired layer was asked for twice (a second "
                               "backward through one forward, retain_graph=True); paired layers "
                               "rebuild it once: use full checkpointing for such a run")
        args, kwargs, kind, dtype = self._call
        self._call = None
        unshard = getattr(self.lower, "unshard", None)  # FSDP2: gather the lower layer
        if unshard is not None:
            unshard()
        with torch.no_grad(), torch.autocast(kind, dtype=dtype, enabled=dtype is not None):
            out = unwrap_layer(self.lower)(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def _unpack(packed):
    return packed.link.rebuild() if isinstance(packed, _Rebuild) else packed


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden-state input of a decoder layer's call."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor):
        raise TypeError("a full-paired layer needs the hidden states as its first argument or "
                        "as hidden_states=")
    return hidden
