"""Where the parts of a causal LM are: its decoder layers (one finder for checkpointing and
FSDP2 alike), the wrappers lctrain puts around them, and its output head."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from lctrain.errors import UserError


def decoder_layer_slots(model: nn.Module) -> list[tuple[nn.ModuleList, int]]:
    """The decoder blocks of ``model`` as (container, index) pairs, in order: replacing
    ``container[index]`` replaces the layer.

    Looked for in ``get_decoder().layers`` (``num_hidden_layers`` of them), then the classes of
    ``_no_split_modules``, then the largest list of identical blocks (UserError: none);
    wrappers count as the block they wrap."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if count is not None and get_decoder else None
    if isinstance(layers, nn.ModuleList) and len(layers) == count:
        return [(layers, i) for i in range(len(layers))]
    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    found = [(lst, i) for lst in lists for i, child in enumerate(lst)
             if type(bare(child)).__name__ in names]
    if found:
        return found
    candidates = [lst for lst in lists
                  if len({type(bare(c)) for c in lst}) == 1
                  and any(p.numel() for p in lst.parameters())]
    if not candidates:
        raise UserError(f"cannot find the decoder layers of {type(model).__name__}: it has no "
                        "list of repeated blocks; lctrain supports decoder-only models with a "
                        "list of layers")
    best = max(candidates, key=lambda lst: sum(p.numel() for p in lst.parameters()))
    return [(best, i) for i in range(len(best))]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers themselves (wrappers included), in order (`decoder_layer_slots`)."""
    return [container[index] for container, index in decoder_layer_slots(model)]


def bare(module: nn.Module) -> nn.Module:
    """``module`` without its ``ActivationWrapper`` layers (tiles, deferral, checkpointing)."""
    while isinstance(module, ActivationWrapper):
        module = module._checkpoint_wrapped_module
    return module


class DeferredNorm(ActivationWrapper):
    """A decoder layer's norm whose work moved into the module that reads its output (the MLP's
    tiles, `lctrain.parallel.tiling`; the grouped attention block). That module runs the norm
    itself, keeping the norm's input, a tensor the layer holds anyway, instead of its output, and
    recomputes the norm in its backward. `DeferredNorm` stands in the norm's place: its forward
    returns the input as it is, and the parameters stay where they were (same names, state dicts
    and checkpoints); `bare` gives the norm."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def output_head(model: nn.Module) -> nn.Linear:
    """The output projection (vocab × hidden); a ValueError unless a bias-free linear layer."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"{type(model).__name__}'s output head is not a bias-free linear layer, "
                         "which the chunked cross-entropy needs")
    return head


def head_inputs(model: nn.Module, **decoder_inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states (B, S, H) and the head weight (V, H), in the compute dtype."""
    hidden = model.get_decoder()(use_cache=False, **decoder_inputs).last_hidden_state
    weight = output_head(model).weight
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return hidden.to(dtype), weight.to(dtype)
