"""The attention operator: ``torch.ops.lctrain.dist_attention`` and its backward.

Every attention lctrain computes — on one device or over a sequence-parallel group — is this
one custom op; local attention is a group of one, whose plan is a single block covering the
whole sequence with no communication (run straight through ``blocks``, without the plan walk).
Its public entry points are in :mod:`lctrain_kernels.api`, which checks the arguments once and
turns them into the op's plain values.

Forward: the op runs the schedule's forward plan (:mod:`~lctrain_kernels.distributed.executor`)
and returns this rank's output rows and their global log-sum-exp. Backward (the op
``lctrain::dist_attention_backward``): the backward plan from the saved q, k, v, the FINAL out
and lse — never the forward again — and the lse's gradient when a loss uses it (each backend
folds it into its ``delta``, see :mod:`lctrain_kernels.backends.base`). That is what
rematerialization-aware checkpointing relies on: marking ``torch.ops.lctrain.dist_attention``
as must-save keeps (out, lse) and skips the attention forward and its communication in the
recompute, for local and distributed attention alike.

The op takes plain values only, so ``torch.compile`` can trace it (``register_fake`` gives the
shapes): the group by name (``group.group_name``, resolved with ``_resolve_process_group``; ""
means a single rank), the document bounds as an int list (empty for none), the schedule and
backend names, the overlap flag, the number of head groups run one after the other
(:func:`~lctrain_kernels.distributed.executor.forward_in_groups`).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from lctrain_kernels.blocks import block_backward, block_forward
from lctrain_kernels.distributed.accumulate import OutAcc, lse_dtype
from lctrain_kernels.distributed.comm import Exchanger
from lctrain_kernels.distributed.executor import (BackwardEngine, ForwardEngine, Geometry,
                                                  backward_in_groups, forward_in_groups,
                                                  pruned_plan)
from lctrain_kernels.masks import MaskSpec
from lctrain_kernels.vocabulary import schedule_layout


def _whole(causal: bool, doc_bounds: list[int]) -> MaskSpec:
    """The one block of a single rank: every query against every key, from position 0. Every
    schedule's plan for one rank reduces to it, so it runs without walking a plan."""
    return MaskSpec(causal, doc_bounds=tuple(doc_bounds) if doc_bounds else None)


def _setup(q, group_name: str, causal: bool, doc_bounds: list[int], schedule: str):
    group = _resolve_process_group(group_name) if group_name else None
    exch = Exchanger(group)
    geo = Geometry(q.shape[1] * exch.world_size, exch.world_size, schedule_layout(schedule),
                   causal, tuple(doc_bounds) if doc_bounds else None)
    return exch, geo


def forward_group(q, k, v, group_name: str, causal: bool, doc_bounds: list[int],
                  softmax_scale: float, schedule: str, backend: str, overlap: bool):
    """The forward of one head group (contiguous (B, n, h, D) inputs): (out, lse)."""
    if not group_name:
        got = block_forward(q, k, v, _whole(causal, doc_bounds), scale=softmax_scale,
                            backend=backend)
        out, lse = got if got is not None else OutAcc(q.shape[1]).result(q)
        return out.contiguous(), lse.to(lse_dtype(q.dtype)).contiguous()
    exch, geo = _setup(q, group_name, causal, doc_bounds, schedule)
    engine = ForwardEngine(pruned_plan(schedule, "forward", geo), geo, exch, overlap, q, k, v,
                           softmax_scale, backend)
    engine.run()
    out, lse = engine.acc.result(q)
    return out.contiguous(), lse.contiguous()  # (B, n, h, D), (B, h, n)


def backward_group(do, q, k, v, out, lse, dlse, group_name: str, causal: bool,
                   doc_bounds: list[int], softmax_scale: float, schedule: str, backend: str,
                   overlap: bool):
    """The backward of one head group: (dq, dk, dv), contiguous, in the inputs' dtypes."""
    if not group_name:
        got = block_backward(do, q, k, v, out, lse, _whole(causal, doc_bounds),
                             scale=softmax_scale, backend=backend, dlse=dlse)
        if got is None:  # no pair visible: no gradient
            return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
        return tuple(g.to(x.dtype).contiguous() for g, x in zip(got, (q, k, v)))
    exch, geo = _setup(q, group_name, causal, doc_bounds, schedule)
    engine = BackwardEngine(pruned_plan(schedule, "backward", geo), geo, exch, overlap, do, q, k,
                            v, out, lse, softmax_scale, backend, dlse=dlse)
    engine.run()
    return (engine.dq.result(q).contiguous(), engine.dk.result(k).contiguous(),
            engine.dv.result(v).contiguous())


@torch.library.custom_op("lctrain::dist_attention", mutates_args=())
def dist_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                      causal: bool, doc_bounds: list[int], softmax_scale: float, schedule: str,
                      backend: str, overlap: bool, head_groups: int = 1
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    run = functools.partial(forward_group, group_name=group_name, causal=causal,
                            doc_bounds=doc_bounds, softmax_scale=softmax_scale, schedule=schedule,
                            backend=backend, overlap=overlap)
    return forward_in_groups(run, q, k, v, head_groups)


@dist_attention_op.register_fake
def _(q, k, v, group_name, causal, doc_bounds, softmax_scale, schedule, backend, overlap,
      head_groups=1):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=lse_dtype(q.dtype))  # contiguous


@torch.library.custom_op("lctrain::dist_attention_backward", mutates_args=())
def dist_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                               group_name: str, causal: bool, doc_bounds: list[int],
                               softmax_scale: float, schedule: str, backend: str, overlap: bool,
                               dlse: Optional[torch.Tensor] = None, head_groups: int = 1
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    run = functools.partial(backward_group, group_name=group_name, causal=causal,
                            doc_bounds=doc_bounds, softmax_scale=softmax_scale, schedule=schedule,
                            backend=backend, overlap=overlap)
    return backward_in_groups(run, do, q, k, v, out, lse, dlse, head_groups)


@dist_attention_backward_op.register_fake
def _(do, q, k, v, out, lse, group_name, causal, doc_bounds, softmax_scale, schedule, backend,
      overlap, dlse=None, head_groups=1):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options, ctx.head_groups = options[:7], (options[7] if len(options) > 7 else 1)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    """dq, dk, dv from dO and, when a loss used the lse, from its gradient: one backward."""
    q, k, v, out, lse = ctx.saved_tensors
    do = torch.zeros_like(out) if dout is None else dout.contiguous()  # (B, n, Hq, D)
    dlse = None if dlse is None else dlse.to(lse.dtype).contiguous()  # (B, Hq, n)
    grads = torch.ops.lctrain.dist_attention_backward(do, q, k, v, out, lse, *ctx.options, dlse,
                                                      ctx.head_groups)
    return (*grads, None, None, None, None, None, None, None, None)


dist_attention_op.register_autograd(_backward, setup_context=_setup_context)
