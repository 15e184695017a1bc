"""Sequence tiling of each decoder layer's MLP and norms: the forward keeps only the input, the
backward recomputes one tile at a time (weight gradients summed in float32, random state
replayed). ``apply_tiling(model, 8192)`` after LoRA, before checkpointing and FSDP2."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from lctrain.errors import UserError
from lctrain.model.families import family
from lctrain.model.structure import DeferredNorm, bare, decoder_layers
from lctrain_kernels.api import tiled_apply

TILED_CHILDREN = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "mlp")
"""Decoder-layer children that act on each token alone: the gated MLP and the norms."""

PRE_MLP_NORM = "post_attention_layernorm"
"""The norm right before the MLP in the families whose layers have one there."""


class TiledModule(ActivationWrapper):
    """Runs a token-wise ``module`` in tiles of ``tile_tokens``, ``pre`` first in each tile."""

    def __init__(self, module: nn.Module, tile_tokens: int, pre: nn.Module | None = None) -> None:
        super().__init__(module)
        self.tile_tokens = int(tile_tokens)
        self.__dict__["pre"] = pre  # not a child of this module: it stays in its layer

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        module, pre = self._checkpoint_wrapped_module, self.pre
        if args or kwargs:
            return module(hidden_states, *args, **kwargs)
        run = module if pre is None else lambda x: module(pre(x))
        if hidden_states.numel() // max(hidden_states.shape[-1], 1) <= self.tile_tokens:
            return run(hidden_states)
        params = [p for m in (pre, module) if m is not None
                  for p in m.parameters() if p.requires_grad]
        return tiled_apply(run, hidden_states, self.tile_tokens, params, check=self._check)

    def _check(self, y, x: torch.Tensor) -> None:
        if not isinstance(y, torch.Tensor) or y.shape[:-1] != x.shape[:-1]:
            raise UserError(f"train.tile_tokens cannot tile "
                            f"{type(self._checkpoint_wrapped_module).__name__}: it must map each "
                            f"token to one output row, but returned {type(y).__name__} "
                            f"{tuple(getattr(y, 'shape', ()))} for input {tuple(x.shape)}; set "
                            "train.tile_tokens=0")

    def extra_repr(self) -> str:
        pre = f", pre={type(self.pre).__name__}" if self.pre is not None else ""
        return f"tile_tokens={self.tile_tokens}{pre}"


def apply_tiling(model: nn.Module, tile_tokens: int, defer_norm: bool = True) -> int:
    """Wrap every decoder layer's token-wise children (in place) in tiles of ``tile_tokens``
    (0 unwraps; ``defer_norm``: the norm before the MLP in its tiles); returns how many.
    UserError: a negative size, or layers without an ``mlp``."""
    if tile_tokens < 0:
        raise UserError(f"train.tile_tokens is {tile_tokens} but must be 0 (off) or a positive "
                        "number of tokens per tile, e.g. 8192")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fold = bool(tile_tokens) and defer_norm and family(model_type) is not None
    wrapped = 0
    for layer in decoder_layers(model):
        layer = bare(layer)
        if tile_tokens and not isinstance(getattr(layer, "mlp", None), nn.Module):
            raise UserError(f"train.tile_tokens tiles each decoder layer's mlp, but "
                            f"{type(layer).__name__} has no mlp module; set train.tile_tokens=0")
        pre_mlp = getattr(layer, PRE_MLP_NORM, None)
        if isinstance(pre_mlp, nn.Module):
            pre_mlp = bare(pre_mlp)
            setattr(layer, PRE_MLP_NORM, pre_mlp)
        folded = fold and isinstance(pre_mlp, nn.Module)
        for name in TILED_CHILDREN:  # (re)wrap the layer's token-wise children
            if name == PRE_MLP_NORM and folded:
                layer.post_attention_layernorm = DeferredNorm(pre_mlp)
                wrapped += 1
            elif not isinstance(getattr(layer, name, None), DeferredNorm):  # else: the attention's
                pre = pre_mlp if folded and name == "mlp" else None
                wrapped += _tile_child(layer, name, tile_tokens, pre)
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):  # the final norm, whose output feeds the loss
        wrapped += _tile_child(get_decoder(), "norm", tile_tokens)
    return wrapped


def _tile_child(parent: nn.Module, name: str, tile_tokens: int,
                pre: nn.Module | None = None) -> bool:
    """(Re)wrap ``parent.<name>`` in tiles of ``tile_tokens`` (0: unwrap; ``pre``: as
    `TiledModule`'s); whether it was wrapped."""
    child = getattr(parent, name, None)
    if not isinstance(child, nn.Module):
        return False
    inner = bare(child)
    setattr(parent, name, TiledModule(inner, tile_tokens, pre) if tile_tokens else inner)
    return bool(tile_tokens)
