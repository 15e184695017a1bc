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
- ``auto``: a policy per layer (``layer_policies``, one of `lctrain.config.tiers.LAYER_POLICIES`
  each: none, remat, remat-offload, full, or ``full-offload`` — full whose layer input waits in
  pinned host memory), as the memory model places them: layers the GPU has room for are not
  checkpointed at all. Offloaded layers share one offloader; when the backward reaches a
  checkpointed layer that keeps its tensors on the GPU, the copies of the last offloaded layer
  start coming back, so the first one the backward needs is not waited for.
  ``full-paired`` layers come in pairs of a full layer and a ``chained`` one above it, whose
  input is not kept but rebuilt from the full layer's in the backward (`lctrain.parallel.pairs`).

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
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    noop_context_fn)
from torch.utils._python_dispatch import TorchDispatchMode

from lctrain.config.training import CHECKPOINTING_POLICIES as POLICIES
from lctrain.config.tiers import LAYER_KINDS, LAYER_POLICIES, OFFLOADED, format_layer_policies
from lctrain.errors import UserError
from lctrain.model.structure import decoder_layer_slots, unwrap_layer
from lctrain.parallel.offload import Offloader
from lctrain.parallel.pairs import PairLink

ATTENTION_FORWARD_OPS = frozenset({
    "lctrain::dist_attention",                        # lctrain_kernels: every attention, cp >= 1
    "lctrain::attention_block",                       # the same with its projections, in groups
    "aten::_scaled_dot_product_cudnn_attention",      # torch's context_parallel ring (a peer):
    "aten::_scaled_dot_product_flash_attention",      # its SDPA calls on sharded tensors
    "aten::_scaled_dot_product_efficient_attention",
})
"""Qualified names of the ops whose outputs ``remat`` keeps: attention forwards that return
(out, lse) and whose backward recomputes attention from (q, k, v, out, lse). lctrain's own
attention is one op for every backend and cp degree, or with head groups an op that projects
q, k and v inside it too (`lctrain.model.grouped_attention`); the SDPA ops are there for the
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


def apply_checkpointing(model: nn.Module, policy: str, *, layer_policies: list[str] | None = None,
                        offload_min_bytes: int = 1 << 20, offload_prefetch: bool = True) -> int:
    """Wrap every decoder layer of ``model`` (in place) for ``policy``.

    Call it before FSDP2. Calling it again replaces the previous policy; ``none`` unwraps.
    transformers' own gradient checkpointing is switched off (this owns the policy), and so is
    ``config.use_cache`` under a recomputing policy.

    Args:
        model: any transformers decoder (or module holding repeated blocks).
        policy: none | full | remat | remat-offload | auto.
        layer_policies: with ``auto``, every layer's policy in forward order (names of
            `lctrain.config.tiers.LAYER_POLICIES`; `lctrain.config.tiers.per_layer` expands runs).
        offload_min_bytes: offloaded layers leave tensors smaller than this on the device.
        offload_prefetch: bring an offloaded layer's tensors back while the layer above runs
            its backward (False: when its own recompute starts; `lctrain.parallel.offload`).

    Returns:
        The number of layers wrapped (0 for ``none``; ``auto``'s ``none`` layers are not).

    Raises:
        UserError: an unknown policy, ``auto`` without one policy per layer, or no decoder
            layers found.
    """
    if policy not in (*POLICIES, "auto"):
        raise UserError(f"checkpointing policy {policy!r} is unknown; choose one of "
                        f"{', '.join(POLICIES)}, auto")
    layers = decoder_layer_slots(model)
    kinds = _layer_kinds(policy, layer_policies, len(layers))
    _hand_over_from_transformers(model, policy)
    offloader = (Offloader(offload_min_bytes, offload_prefetch)
                 if OFFLOADED.intersection(kinds) else None)
    links = {i: PairLink() for i, kind in enumerate(kinds[1:]) if kind == "chained"}
    wrapped = 0
    for i, ((container, index), kind) in enumerate(zip(layers, kinds)):
        layer = unwrap_layer(container[index])
        if kind == "none":
            container[index] = layer
            continue
        wrapped += 1
        container[index] = _wrap(layer, kind, offloader, lower_of=links.get(i),
                                 upper_of=links.get(i - 1) if kind == "chained" else None)
        if i in links:
            links[i].lower = container[index]
    return wrapped


def _layer_kinds(policy: str, layer_policies: list[str] | None, count: int) -> list[str]:
    if policy != "auto":
        return [policy] * count
    kinds = list(layer_policies or [])
    unknown = [k for k in kinds if k not in LAYER_KINDS]
    if unknown:
        raise UserError(f"layer policy {unknown[0]!r} is unknown; choose one of "
                        f"{', '.join(LAYER_POLICIES)}")
    if any(k == "chained" and (i == 0 or kinds[i - 1] != "full") for i, k in enumerate(kinds)):
        raise UserError("a chained layer (the upper layer of a full-paired pair) must follow a "
                        "full layer; write the pairs as full-paired=N in train.layer_policies")
    if len(kinds) != count:
        runs = format_layer_policies(tuple((k, 1) for k in kinds)) or "none"
        raise UserError(f"train.layer_policies gives {len(kinds)} layers ({runs}) but the model "
                        f"has {count} decoder layers; make the counts add up to {count}")
    return kinds


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


def _wrap(layer: nn.Module, kind: str, offloader: Offloader | None, *,
          lower_of: PairLink | None = None, upper_of: PairLink | None = None) -> nn.Module:
    """``layer`` in its checkpoint wrapper; ``lower_of`` / ``upper_of``: the pair whose lower
    (a full layer) or upper (a chained layer) it is (`lctrain.parallel.pairs`)."""
    make_contexts = remat_contexts if kind.startswith("remat") else noop_context_fn
    if kind in OFFLOADED:
        saved = is_attention_forward if kind.startswith("remat") else None
        return checkpoint_wrapper(layer, checkpoint_fn=functools.partial(
            _offloaded_checkpoint, offloader, make_contexts, saved))
    if offloader is not None:  # a GPU-kept layer of a mixed run: start the host copies back
        make_contexts = functools.partial(offloader.prefetching_contexts, make_contexts)
    pair = lower_of.lower_checkpoint if lower_of else upper_of.upper_checkpoint if upper_of \
        else None
    if pair is not None:
        return checkpoint_wrapper(layer, checkpoint_fn=functools.partial(pair, make_contexts))
    if kind == "full" and offloader is None:
        return checkpoint_wrapper(layer)
    return checkpoint_wrapper(layer, context_fn=make_contexts)


def _offloaded_checkpoint(offloader: Offloader, make_contexts, saved, module: nn.Module, *args,
                          **kwargs):
    """Checkpoint ``module`` with its input (and, under remat, attention outputs) parked on the
    host."""
    stash = offloader.new_stash()
    context_fn = functools.partial(offloader.contexts, stash, make_contexts, saved)
    with torch.autograd.graph.saved_tensors_hooks(stash.pack, stash.unpack):
        return checkpoint(module, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


class AttentionCounter(TorchDispatchMode):
    """Counts the attention forward ops that actually execute while it is active.

    Enter it around whole training steps (outside any checkpointing): selective checkpointing's
    recompute serves cached attention outputs from a mode above this one, so a cached call is
    not counted, while a re-run one (``full``, ``full-offload``) is. ``counts`` maps op name ->
    calls.
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
