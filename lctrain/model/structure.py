"""Where the parts of a transformers causal LM are, found through public accessors."""
from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks of a causal LM, in order.

    Uses ``model.get_decoder().layers`` (Llama, Mistral, Qwen, ...) and otherwise the module list
    holding ``config.num_hidden_layers`` blocks.

    Raises:
        ValueError: no such list exists (an architecture lctrain does not know how to shard).
    """
    count = getattr(model.config, "num_hidden_layers", None)
    layers = getattr(model.get_decoder(), "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == count:
        return list(layers)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return list(module)
    raise ValueError(f"cannot find the {count} decoder layers of {type(model).__name__}; "
                     "lctrain supports decoder-only models with a list of layers")


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
