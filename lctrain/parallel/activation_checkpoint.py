"""Activation checkpointing of every decoder layer, before FSDP2: ``none`` keeps everything,
``full`` its input, ``remat`` (DistFlashAttn's) also the attention output so attention runs once
per layer and step; parked layers keep theirs in pinned host memory (`offload`)."""
from __future__ import annotations

import functools
from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts, noop_context_fn)

from lctrain.config.layers import LayerPlan
from lctrain.model.structure import bare, decoder_layer_slots
from lctrain.parallel.offload import Offloader

ATTENTION_FORWARD_OPS = frozenset({"lctrain::dist_attention", "lctrain::attention_block"})
"""The ops whose (out, lse) ``remat`` keeps: lctrain's attention, with or without projections."""


def op_name(func) -> str:
    """``"namespace::op"`` of an OpOverload (without the overload name)."""
    return func.name().split(".", 1)[0]


def is_attention_forward(func) -> bool:
    """Whether ``func`` is one of :data:`ATTENTION_FORWARD_OPS`."""
    return op_name(func) in ATTENTION_FORWARD_OPS


def remat_contexts():
    """`context_fn` for `torch.utils.checkpoint.checkpoint` implementing ``remat``: keep
    attention forwards, recompute everything else."""
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        return (CheckpointPolicy.MUST_SAVE if is_attention_forward(func)
                else CheckpointPolicy.PREFER_RECOMPUTE)
    return create_selective_checkpoint_contexts(policy)


def apply_checkpointing(model: nn.Module, layers: LayerPlan | str, *,
                        offload_min_bytes: int = 1 << 20) -> int:
    """Wrap every decoder layer of ``model`` in place as ``layers`` says (a string: the
    train.checkpointing text); parked layers leave tensors < ``offload_min_bytes``; returns how
    many were wrapped. UserError: an unknown kind, ``auto``, runs not covering the layers."""
    plan = LayerPlan.parse(layers) if isinstance(layers, str) else layers
    slots = decoder_layer_slots(model)
    kinds, parked = plan.kinds(len(slots)), plan.parked_layers(len(slots))
    # transformers' own checkpointing off, and its KV cache too when layers are recomputed
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        (getattr(model, "activation_checkpointing_disable", None)  # transformers ≥ 5.2x
         or model.gradient_checkpointing_disable)()
    config = getattr(model, "config", None)
    if any(kind != "none" for kind in kinds) and getattr(config, "use_cache", False):
        config.use_cache = False
    offloader = Offloader(offload_min_bytes) if any(parked) else None
    for (container, index), kind, is_parked in zip(slots, kinds, parked):
        layer = bare(container[index])
        container[index] = layer if kind == "none" else _wrap(layer, kind, is_parked, offloader)
    return sum(kind != "none" for kind in kinds)


def _wrap(layer: nn.Module, kind: str, parked: bool, offloader: Offloader | None) -> nn.Module:
    """``layer`` in its checkpoint wrapper."""
    make_contexts = remat_contexts if kind == "remat" else noop_context_fn
    if parked:
        saved = is_attention_forward if kind == "remat" else None
        return checkpoint_wrapper(layer, checkpoint_fn=functools.partial(
            _parked_checkpoint, offloader, make_contexts, saved))
    if offloader is not None:  # a GPU-kept layer of a run with parked ones: start their copies
        make_contexts = functools.partial(offloader.prefetching_contexts, make_contexts)
    return checkpoint_wrapper(layer, context_fn=make_contexts)


def _parked_checkpoint(offloader: Offloader, make_contexts, saved, module: nn.Module, *args,
                       **kwargs):
    """Checkpoint ``module`` with its input (and, under remat, attention outputs) parked."""
    stash = offloader.new_stash()
    context_fn = functools.partial(offloader.contexts, stash, make_contexts, saved)
    with torch.autograd.graph.saved_tensors_hooks(stash.pack, stash.unpack):
        return checkpoint(module, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


class AttentionCounter(TorchDispatchMode):
    """Counts the attention forwards that execute while active (remat's cached ones do not)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_attention_forward(func):
            self.counts[op_name(func)] += 1
        return func(*args, **(kwargs or {}))
