"""Where the parts of a causal LM are: its repeated decoder layers and its output head.

Parallelism is applied from outside the model, so whoever wraps layers (the checkpointing
policies) or shards them (FSDP2) asks here where they are. One finder serves all of them, so
the layers that are checkpointed are the very layers that FSDP2 makes its units.
"""
from __future__ import annotations

from torch import nn

from lctrain.errors import UserError


def decoder_layer_slots(model: nn.Module) -> list[tuple[nn.ModuleList, int]]:
    """The repeated decoder blocks of ``model`` as (container, index) pairs, in order.

    Looked for, in this order: ``model.get_decoder().layers`` when it holds
    ``config.num_hidden_layers`` blocks (Llama, Mistral, Qwen, ...); the blocks of the classes
    named by ``model._no_split_modules`` (transformers' own list of the classes that must not be
    split); the largest `nn.ModuleList` of identical blocks with parameters. A block wrapped in
    place (a checkpoint wrapper) counts as the block it wraps.

    Args:
        model: a transformers causal LM, or any module holding a list of repeated blocks.

    Returns:
        ``[(container, index), ...]``: ``container[index]`` is a layer; replacing it there
        replaces the layer in the model.

    Raises:
        UserError: no list of repeated blocks found (an architecture lctrain cannot split).
    """
    layers = _decoder_accessor_layers(model)
    if layers is not None:
        return [(layers, i) for i in range(len(layers))]
    names = set(getattr(model, "_no_split_modules", None) or ())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if names:
        found = [(lst, i) for lst in lists for i, child in enumerate(lst)
                 if type(unwrap_layer(child)).__name__ in names]
        if found:
            return found
    candidates = [lst for lst in lists
                  if len({type(unwrap_layer(c)) for c in lst}) == 1
                  and any(p.numel() for p in lst.parameters())]
    if not candidates:
        raise UserError(f"cannot find the decoder layers of {type(model).__name__}: it has no "
                        "list of repeated blocks; lctrain supports decoder-only models with a "
                        "list of layers")
    best = max(candidates, key=lambda lst: sum(p.numel() for p in lst.parameters()))
    return [(best, i) for i in range(len(best))]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers themselves (wrappers included), in order (see `decoder_layer_slots`).

    Raises:
        UserError: no list of repeated blocks found.
    """
    return [container[index] for container, index in decoder_layer_slots(model)]


def unwrap_layer(module: nn.Module) -> nn.Module:
    """The block inside a checkpoint wrapper (torch's ``checkpoint_wrapper``), else ``module``."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def _decoder_accessor_layers(model: nn.Module) -> nn.ModuleList | None:
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    get_decoder = getattr(model, "get_decoder", None)
    if count is None or get_decoder is None:
        return None
    layers = getattr(get_decoder(), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) == count else None


def output_head(model: nn.Module) -> nn.Linear:
    """The output projection (vocab × hidden), checked to be a plain bias-free linear map.

    Raises:
        ValueError: the head has a bias or is not a linear layer.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"{type(model).__name__}'s output head is not a bias-free linear layer, "
                         "which the chunked cross-entropy needs")
    return head
