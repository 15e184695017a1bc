"""The attention operator: ``torch.ops.lctrain.dist_attention`` and its backward.

Every attention lctrain computes, on one device or over a sequence-parallel group, is this one
custom op; a group of one runs a single block. Forward: the schedule's forward plan, returning this
rank's rows and their global log-sum-exp. Backward: the backward plan from the saved q, k, v and the
FINAL out and lse (never the forward again), so checkpointing that keeps (out, lse) runs the
attention and its communication once. The op takes plain values only (the group by name, "" for one
rank; ``register_fake`` gives shapes, so ``torch.compile`` traces it)."""
from __future__ import annotations

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


def _setup(q, direction: str, group_name: str, causal: bool, doc_bounds: list[int],
           schedule: str):
    """(plan, geometry, exchanger) of one direction of a call, an engine's first arguments; a
    group of one runs its one block whole, whatever the schedule's layout."""
    exch = Exchanger(_resolve_process_group(group_name) if group_name else None)
    schedule = schedule if group_name else "distflash"
    geo = Geometry(q.shape[1] * exch.world_size, exch.world_size, schedule_layout(schedule),
                   causal, tuple(doc_bounds) if doc_bounds else None)
    return pruned_plan(schedule, direction, geo), geo, exch


def forward_group(q, k, v, group_name: str, causal: bool, doc_bounds: list[int],
                  softmax_scale: float, schedule: str, backend: str, overlap: bool):
    """The forward of one head group (contiguous (B, n, h, D) inputs): (out, lse)."""
    engine = ForwardEngine(*_setup(q, "forward", group_name, causal, doc_bounds, schedule),
                           overlap, q, k, v, softmax_scale, backend)
    engine.run()
    if group_name:
        bound_host_lead(q.device)
    out, lse = engine.acc.result(q)
    return out.contiguous(), lse.contiguous()  # (B, n, h, D), (B, h, n)


def backward_group(do, q, k, v, out, lse, dlse, group_name: str, causal: bool,
                   doc_bounds: list[int], softmax_scale: float, schedule: str, backend: str,
                   overlap: bool):
    """The backward of one head group: (dq, dk, dv), contiguous, in the inputs' dtypes."""
    engine = BackwardEngine(*_setup(q, "backward", group_name, causal, doc_bounds, schedule),
                            overlap, do, q, k, v, out, lse, softmax_scale, backend, dlse=dlse)
    engine.run()
    if group_name:
        bound_host_lead(q.device)
    return (engine.dq.result(q).contiguous(), engine.dk.result(k).contiguous(),
            engine.dv.result(v).contiguous())


def messages_only(direction: str, q: torch.Tensor, k: torch.Tensor, group,
                  schedule: str = "distflash", doc_bounds=None) -> None:
    """Move the messages of one direction of a schedule's causal plan without computing (the
    bench's communication time); q (B, n, Hq, D) and k (B, n, Hkv, D) are this rank's rows."""
    setup = _setup(q, direction, group.group_name, True, list(doc_bounds or ()), schedule)
    if direction == "forward":
        ForwardEngine(*setup, False, q, k, k, 1.0, "reference", compute=False).run()
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        BackwardEngine(*setup, False, q, q, k, k, q, lse, 1.0, "reference", compute=False).run()


@torch.library.custom_op("lctrain::dist_attention", mutates_args=())
def dist_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                      causal: bool, doc_bounds: list[int], softmax_scale: float, schedule: str,
                      backend: str, overlap: bool, head_groups: int = 1
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    options = (group_name, causal, doc_bounds, softmax_scale, schedule, backend, overlap)
    return forward_in_groups(lambda *qkv: forward_group(*qkv, *options), q, k, v, head_groups)


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
    options = (group_name, causal, doc_bounds, softmax_scale, schedule, backend, overlap)
    return backward_in_groups(lambda *t: backward_group(*t, *options), do, q, k, v, out, lse, dlse,
                              head_groups)


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
