"""Activation checkpointing policies, applied from outside to every decoder layer.

    apply_checkpointing(model, "remat")     # before FSDP2's fully_shard, like torchtitan

Policies (the recipe's ``train.checkpointing``):

- ``none``: every layer keeps all its activations for the backward.
- ``full``: layer-level recompute (non-reentrant `torch.utils.checkpoint`): a layer keeps only
  its input and re-runs its whole forward in the backward — including the attention forward and
  all its communication, which a flash-style backward then does not even need.
- ``remat``: DistFlashAttn's rematerialization-aware checkpointing, done with selective
  activation checkpointing: inside each checkpointed layer the attention forward
  (:data:`ATTENTION_FORWARD_OPS`: ``lctrain::dist_attention``, the one op of lctrain's local
  and distributed attention, with any backend) is MUST_SAVE and everything else
  PREFER_RECOMPUTE. In the backward the projections, norms, RoPE and MLP are
  recomputed while the attention op returns its cached (out, lse); its autograd backward gets
  the recomputed q, k, v and the saved out, lse — so the attention forward and its
  communication run exactly once per layer per step. Cost: one (tokens × hidden) output and an
  fp32 lse per layer beyond ``full``.
- ``remat-offload``: ``remat`` whose kept tensors (layer inputs, attention outputs) wait in
  pinned host memory, copied out and back on a side stream (`lctrain.parallel.offload`).

The decoder layers are those `lctrain.model.structure.decoder_layer_slots` finds (the same
ones FSDP2 makes its units). Each is wrapped in place with torch's ``checkpoint_wrapper``
(parameter names gain ``_checkpoint_wrapped_module.``; ``state_dict()`` and distributed
checkpoint strip it). Apply it BEFORE FSDP2 so that FSDP2's all-gather hooks sit
outside the recomputed region.
"""
from __future__ import annotations

import functools
from collections import Counter

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils._python_dispatch import TorchDispatchMode

from lctrain.config.schema import CHECKPOINTING_POLICIES as POLICIES
from lctrain.errors import UserError
from lctrain.model.structure import decoder_layer_slots, unwrap_layer
from lctrain.parallel.offload import Offloader

ATTENTION_FORWARD_OPS = frozenset({
    "lctrain::dist_attention",                        # lctrain_kernels: every attention, cp >= 1
    "aten::_scaled_dot_product_cudnn_attention",      # torch's context_parallel ring (a peer):
    "aten::_scaled_dot_product_flash_attention",      # its SDPA calls on sharded tensors
    "aten::_scaled_dot_product_efficient_attention",
})
"""Qualified names of the ops whose outputs ``remat`` keeps: attention forwards that return
(out, lse) and whose backward recomputes attention from (q, k, v, out, lse). lctrain's own
attention is one op for every backend and cp degree; the SDPA ops are there for the
``context_parallel`` schedule, torch's ring attention, the peer measured against."""


def op_name(func) -> str:
    """``"namespace::op"`` of an OpOverload (without the overload name)."""
    name = func.name() if hasattr(func, "name") else str(func)
    return name.split(".", 1)[0]


def is_attention_forward(func) -> bool:
    """Whether ``func`` is one of :data:`ATTENTION_FORWARD_OPS`."""
    return op_name(func) in ATTENTION_FORWARD_OPS


def remat_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpointing policy: keep attention forwards, recompute everything else."""
    if is_attention_forward(func):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def remat_contexts():
    """`context_fn` for `torch.utils.checkpoint.checkpoint` implementing ``remat``."""
    return create_selective_checkpoint_contexts(remat_policy)


def apply_checkpointing(model: nn.Module, policy: str, *, offload_min_bytes: int = 1 << 20) -> int:
    """Wrap every decoder layer of ``model`` (in place) for ``policy``.

    Call it before FSDP2. Calling it again replaces the previous policy; ``none`` unwraps.
    transformers' own gradient checkpointing is switched off (this owns the policy), and so is
    ``config.use_cache`` under a recomputing policy.

    Args:
        model: any transformers decoder (or module holding repeated blocks).
        policy: none | full | remat | remat-offload.
        offload_min_bytes: remat-offload leaves tensors smaller than this on the device.

    Returns:
        The number of layers wrapped (0 for ``none``).

    Raises:
        UserError: an unknown policy, or no decoder layers found.
    """
    if policy not in POLICIES:
        raise UserError(f"checkpointing policy {policy!r} is unknown; choose one of "
                        f"{', '.join(POLICIES)}")
    _hand_over_from_transformers(model, policy)
    layers = decoder_layer_slots(model)
    offloader = Offloader(offload_min_bytes) if policy == "remat-offload" else None
    for container, index in layers:
        layer = unwrap_layer(container[index])
        container[index] = layer if policy == "none" else _wrap(layer, policy, offloader)
    return 0 if policy == "none" else len(layers)


def _hand_over_from_transformers(model: nn.Module, policy: str) -> None:
    """Switch transformers' own checkpointing off (it would checkpoint twice) and, when layers
    are recomputed, the KV cache too (a recompute would append its keys to the cache again)."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        disable = (getattr(model, "activation_checkpointing_disable", None)  # transformers ≥ 5.2x
                   or model.gradient_checkpointing_disable)
        disable()
    config = getattr(model, "config", None)
    if policy != "none" and getattr(config, "use_cache", False):
        config.use_cache = False


def _wrap(layer: nn.Module, policy: str, offloader: Offloader | None) -> nn.Module:
    if policy == "full":
        return checkpoint_wrapper(layer)
    if policy == "remat":
        return checkpoint_wrapper(layer, context_fn=remat_contexts)
    return checkpoint_wrapper(layer, checkpoint_fn=functools.partial(_offloaded_checkpoint,
                                                                     offloader))


def _offloaded_checkpoint(offloader: Offloader, module: nn.Module, *args, **kwargs):
    """Checkpoint ``module`` with remat, its input and attention outputs parked on the host."""
    stash = offloader.new_stash()
    context_fn = functools.partial(offloader.contexts, stash, remat_contexts, is_attention_forward)
    with torch.autograd.graph.saved_tensors_hooks(stash.pack, stash.unpack):
        return checkpoint(module, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


class AttentionCounter(TorchDispatchMode):
    """Counts the attention forward ops that actually execute while it is active.

    Enter it around whole training steps (outside any checkpointing): selective checkpointing's
    recompute serves cached attention outputs from a mode above this one, so a cached call is
    not counted, while a re-run one (``full``) is. ``counts`` maps op name -> calls.
    """

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
