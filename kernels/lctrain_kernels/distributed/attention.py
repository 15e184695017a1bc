"""``dist_attention``: sequence-parallel attention as the custom op ``lctrain::dist_attention``.

Each rank passes its own rows of q, k, v (sharded with :func:`~lctrain_kernels.distributed.shard`
in the layout of the chosen schedule). The op runs the schedule's forward plan
(:mod:`~lctrain_kernels.distributed.executor`) and returns this rank's output rows and their
global log-sum-exp. Its backward (the op ``lctrain::dist_attention_backward``) runs the backward
plan from the saved q, k, v, the FINAL out and lse — never the forward again — which is what
rematerialization-aware checkpointing relies on: marking ``torch.ops.lctrain.dist_attention``
as must-save keeps (out, lse) and skips the attention forward and its communication in the
recompute.

The op takes plain values only, so ``torch.compile`` can trace it: the group by name
(``group.group_name``, resolved with ``_resolve_process_group``; "" means a single rank), the
document bounds as an int list (empty for none), schedule and backend names, the overlap flag.
A world of one rank runs the same executor with no communication.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from lctrain_kernels.distributed.comm import Exchanger
from lctrain_kernels.distributed.executor import BackwardEngine, ForwardEngine, Geometry, pruned_plan
from lctrain_kernels.distributed.layout import check_seq_len
from lctrain_kernels.distributed.schedule import SCHEDULES, make_schedule
from lctrain_kernels.masks import doc_bounds_from

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _setup(q, group_name: str, causal: bool, doc_bounds: list[int], schedule: str):
    group = _resolve_process_group(group_name) if group_name else None
    exch = Exchanger(group)
    geo = Geometry(q.shape[1] * exch.world_size, exch.world_size, make_schedule(exch.world_size, schedule).layout,
                   causal, tuple(doc_bounds) if doc_bounds else None)
    return exch, geo


@torch.library.custom_op("lctrain::dist_attention", mutates_args=())
def _dist_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                       causal: bool, doc_bounds: list[int], softmax_scale: float, schedule: str,
                       backend: str, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
    exch, geo = _setup(q, group_name, causal, doc_bounds, schedule)
    engine = ForwardEngine(pruned_plan(schedule, "forward", geo), geo, exch, overlap, q, k, v,
                           softmax_scale, backend)
    engine.run()
    out, lse = engine.acc.result(q)
    return out.contiguous(), lse.contiguous()  # (B, n, Hq, D), (B, Hq, n) float32


@_dist_attention_op.register_fake
def _(q, k, v, group_name, causal, doc_bounds, softmax_scale, schedule, backend, overlap):
    b, s, h, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("lctrain::dist_attention_backward", mutates_args=())
def _dist_attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, group_name: str, causal: bool,
                                doc_bounds: list[int], softmax_scale: float, schedule: str,
                                backend: str, overlap: bool
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    exch, geo = _setup(q, group_name, causal, doc_bounds, schedule)
    engine = BackwardEngine(pruned_plan(schedule, "backward", geo), geo, exch, overlap, do, q, k, v,
                            out, lse, softmax_scale, backend)
    engine.run()
    return engine.dq.result(q).contiguous(), engine.dk.result(k).contiguous(), engine.dv.result(v).contiguous()


@_dist_attention_backward_op.register_fake
def _(do, q, k, v, out, lse, group_name, causal, doc_bounds, softmax_scale, schedule, backend, overlap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = options
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    """dq, dk, dv from dO (one distributed backward) and from d lse if a loss used it.

    ``d lse_i / d s_ij = P_ij`` is the ``dS = P (dP − delta)`` of an ordinary backward with
    dO_i = dlse_i e_0, V_j = e_0 and O = 0 (so dP_ij = dlse_i, delta = 0): a second backward
    that runs only when the lse carries a gradient.
    """
    q, k, v, out, lse = ctx.saved_tensors
    grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)] if dout is None else \
        list(torch.ops.lctrain.dist_attention_backward(dout.contiguous(), q, k, v, out, lse, *ctx.options))
    if dlse is not None:
        do_unit = torch.zeros_like(q)  # (B, n, Hq, D): dlse in feature 0
        do_unit[..., 0] = dlse.transpose(1, 2).to(q.dtype)
        v_unit = torch.zeros_like(v)  # (B, n, Hkv, D): e_0 for every key
        v_unit[..., 0] = 1
        extra = torch.ops.lctrain.dist_attention_backward(do_unit, q, k, v_unit, torch.zeros_like(out),
                                                          lse, *ctx.options)
        grads[0], grads[1] = grads[0] + extra[0], grads[1] + extra[1]
    return (*grads, None, None, None, None, None, None, None)


_dist_attention_op.register_autograd(_backward, setup_context=_setup_context)


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, local seq, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share "
                         f"batch, local sequence length and head_dim (k and v the same shape).")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"the number of query heads ({q.shape[2]}) must be a multiple of the number "
                         f"of key/value heads ({k.shape[2]}).")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k and v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}.")


def _options(q, group, causal, cu_seqlens, softmax_scale, schedule, backend, overlap) -> tuple:
    """Validate everything once, on the host, and turn it into the op's plain arguments."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    world = 1 if group is None else torch.distributed.get_world_size(group)
    layout = make_schedule(world, schedule).layout
    seq_len = q.shape[1] * world
    check_seq_len(seq_len, world, layout)
    bounds = doc_bounds_from(cu_seqlens)
    if bounds is not None and bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the {world} rank(s) hold {world} × "
                         f"{q.shape[1]} = {seq_len} tokens; pass the GLOBAL cu_seqlens, the same on "
                         f"every rank.")
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}.")
    name = backend if isinstance(backend, str) else getattr(backend, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"backend must be a backend name or a Backend object, got {backend!r}.")
    group_name = group.group_name if group is not None and world > 1 else ""
    return group_name, bool(causal), list(bounds or ()), scale, schedule, name, bool(overlap)


def dist_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                            causal: bool = True, cu_seqlens=None, softmax_scale: float | None = None,
                            schedule: str = "distflash", backend="auto", overlap: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-parallel attention of this rank's rows, with their global log-sum-exp.

    Args:
        q: (B, N/P, Hq, D) this rank's queries, sharded with ``make_schedule(P, schedule).layout``.
        k: (B, N/P, Hkv, D) this rank's keys, ``Hq % Hkv == 0`` (only Hkv heads travel).
        v: (B, N/P, Hkv, D) this rank's values.
        group: the sequence-parallel process group; None (or one rank) runs local attention.
        causal: key ``j`` visible to query ``i`` only if ``j <= i`` (global positions).
        cu_seqlens: GLOBAL document bounds ``[0, ..., N]`` (tensor or ints, identical on every
            rank); attention never crosses a document. None: one document.
        softmax_scale: scale of ``q k^T``; default ``1 / sqrt(D)``.
        schedule: "distflash" (balanced, default), "ring" or "zigzag".
        backend: local attention backend name ("auto", "reference", "cudnn", ...) or Backend.
        overlap: post the next step's transfers before computing the current block (False is
            the ablation that waits right after posting).

    Returns:
        ``(out, lse)``: (B, N/P, Hq, D) in q's dtype and (B, Hq, N/P) float32, natural log; both
        differentiable with respect to q, k and v.

    Raises:
        ValueError: bad shapes, dtypes, schedule name, cu_seqlens, scale, or a global length
            (P × local length) not divisible by the schedule's layout chunking.
    """
    _check_tensors(q, k, v)
    options = _options(q, group, causal, cu_seqlens, softmax_scale, schedule, backend, overlap)
    return torch.ops.lctrain.dist_attention(q, k, v, *options)


def dist_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   cu_seqlens=None, softmax_scale: float | None = None, schedule: str = "distflash",
                   backend="auto", overlap: bool = True) -> torch.Tensor:
    """Sequence-parallel attention of this rank's rows; see :func:`dist_attention_with_lse`.

    Returns:
        (B, N/P, Hq, D) output rows of this rank, in q's dtype, differentiable.

    Raises:
        ValueError: as :func:`dist_attention_with_lse`.
    """
    return dist_attention_with_lse(q, k, v, group, causal, cu_seqlens, softmax_scale, schedule,
                                   backend, overlap)[0]
