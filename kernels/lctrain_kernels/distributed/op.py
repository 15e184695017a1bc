"""The attention operator: ``torch.ops.lctrain.dist_attention`` and its backward.

Every attention lctrain computes, on one device or over a sequence-parallel group, is this one
custom op; a group of one runs a single block. Forward: the schedule's forward plan, returning this
rank's rows and their global log-sum-exp. Backward: the backward plan from the saved q, k, v and the
FINAL out and lse (never the forward again), so checkpointing that keeps (out, lse) runs the
attention and its communication once. The op takes plain values only (the group by name, "" for one
rank; ``register_fake`` gives shapes, so ``torch.compile`` traces it)."""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from lctrain_kernels.backends import check_backend_name
from lctrain_kernels.combine import lse_dtype
from lctrain_kernels.distributed.comm import Exchanger, bound_host_lead
from lctrain_kernels.distributed.executor import (BackwardEngine, ForwardEngine, Geometry,
                                                  backward_in_groups, forward_in_groups,
                                                  pruned_plan)
from lctrain_kernels.masks import doc_bounds_from
from lctrain_kernels.vocabulary import check_schedule, check_seq_len, schedule_layout


def op_options(q, k, group, causal, cu_seqlens, softmax_scale, schedule, backend, overlap,
               head_groups) -> tuple:
    """The public arguments checked once, on the host, as the op's plain ones: (group name,
    causal, document bounds, scale, schedule, backend, overlap, head groups). Reads only the
    shapes of ``q`` (B, S, Hq, D) and ``k`` (B, S, Hkv, D)."""
    check_schedule(schedule)
    world = 1 if group is None else dist.get_world_size(group)
    seq_len = q.shape[1] * world
    check_seq_len(seq_len, world, schedule_layout(schedule))
    bounds = doc_bounds_from(cu_seqlens)
    if bounds is not None and bounds[-1] != seq_len:
        held, fix = "", ""
        if world > 1:
            held = f" ({world} ranks × {q.shape[1]} rows)"
            fix = "; pass the GLOBAL cu_seqlens, the same on every rank"
        raise ValueError(f"cu_seqlens must end at the sequence length {seq_len}{held}, got "
                         f"{bounds[-1]}{fix}.")
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}.")
    if (isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1
            or k.shape[2] % head_groups):
        raise ValueError(f"head_groups must be a positive divisor of the {k.shape[2]} key/value "
                         f"heads, got {head_groups!r}.")
    name = backend if isinstance(backend, str) else getattr(backend, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"backend must be a backend name or a Backend object, got {backend!r}.")
    return (group.group_name if world > 1 else "", bool(causal), list(bounds or ()), scale,
            schedule, check_backend_name(name), bool(overlap), int(head_groups))


def _setup(q, group_name: str, causal: bool, doc_bounds: list[int], schedule: str):
    """(exchanger, geometry, schedule) of a call; a group of one runs its one block whole,
    whatever the schedule's layout."""
    exch = Exchanger(_resolve_process_group(group_name) if group_name else None)
    schedule = schedule if group_name else "distflash"
    geo = Geometry(q.shape[1] * exch.world_size, exch.world_size, schedule_layout(schedule),
                   causal, tuple(doc_bounds) if doc_bounds else None)
    return exch, geo, schedule


def forward_group(q, k, v, group_name: str, causal: bool, doc_bounds: list[int],
                  softmax_scale: float, schedule: str, backend: str, overlap: bool):
    """The forward of one head group (contiguous (B, n, h, D) inputs): (out, lse)."""
    exch, geo, schedule = _setup(q, group_name, causal, doc_bounds, schedule)
    engine = ForwardEngine(pruned_plan(schedule, "forward", geo), geo, exch, overlap, q, k, v,
                           softmax_scale, backend)
    engine.run()
    if group_name:
        bound_host_lead(q.device)
    out, lse = engine.acc.result(q)
    return out.contiguous(), lse.contiguous()  # (B, n, h, D), (B, h, n)


def backward_group(do, q, k, v, out, lse, dlse, group_name: str, causal: bool,
                   doc_bounds: list[int], softmax_scale: float, schedule: str, backend: str,
                   overlap: bool):
    """The backward of one head group: (dq, dk, dv), contiguous, in the inputs' dtypes."""
    exch, geo, schedule = _setup(q, group_name, causal, doc_bounds, schedule)
    engine = BackwardEngine(pruned_plan(schedule, "backward", geo), geo, exch, overlap, do, q, k,
                            v, out, lse, softmax_scale, backend, dlse=dlse)
    engine.run()
    if group_name:
        bound_host_lead(q.device)
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
