"""The attention API, one door: ``dist_attention`` over a process group, ``attention`` on one.

Local attention IS distributed attention on a group of one: all four functions check their
arguments here, once, on the host, and call the one operator ``torch.ops.lctrain.dist_attention``
(:mod:`lctrain_kernels.distributed.op`), which runs a schedule's plan with any local backend —
for one rank a plan of one block covering the whole sequence, with no communication.

Layout is BSHD — q ``(B, S, Hq, D)``, k and v ``(B, S, Hkv, D)`` with ``Hq % Hkv == 0`` — and
the log-sum-exp is ``(B, Hq, S)`` float32 (float64 for float64 inputs), natural log. Both
outputs are differentiable: the backward recomputes the probabilities from the saved q, k, v,
out and lse (no score matrix is kept), as FlashAttention does, and takes the lse's gradient in
the same pass.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

import lctrain_kernels.distributed.op  # noqa: F401 - registers torch.ops.lctrain.dist_attention*
from lctrain_kernels.backends import check_backend_name
from lctrain_kernels.masks import doc_bounds_from
from lctrain_kernels.vocabulary import check_schedule, check_seq_len, schedule_layout

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}.")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q and k must share batch and sequence length (self-attention of this "
                         f"rank's rows), got q {tuple(q.shape)} and k {tuple(k.shape)}.")
    if q.shape[3] != k.shape[3] or q.shape[3] == 0:
        raise ValueError(f"q and k/v must have the same non-zero head_dim, got {q.shape[3]} and "
                         f"{k.shape[3]}.")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"the number of query heads ({q.shape[2]}) must be a multiple of the "
                         f"number of key/value heads ({k.shape[2]}).")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k and v must share one float dtype (float16, bfloat16, float32 or "
                         f"float64), got {q.dtype}, {k.dtype} and {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and "
                         f"{v.device}.")


def _backend_name(backend) -> str:
    """The name of ``backend`` (a name, or a Backend standing for its registered name)."""
    name = backend if isinstance(backend, str) else getattr(backend, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"backend must be a backend name or a Backend object, got {backend!r}.")
    return check_backend_name(name)


def op_options(q, k, group, causal, cu_seqlens, softmax_scale, schedule, backend, overlap,
               head_groups) -> tuple:
    """Validate everything once, on the host, and turn it into the op's plain arguments:
    (group name, causal, document bounds, scale, schedule, backend, overlap, head groups).
    Only the shapes of ``q`` (B, S, Hq, D) and ``k`` (B, S, Hkv, D) are read."""
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
    group_name = group.group_name if world > 1 else ""
    return (group_name, bool(causal), list(bounds or ()), scale, schedule,
            _backend_name(backend), bool(overlap), int(head_groups))


def dist_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                            causal: bool = True, cu_seqlens=None, softmax_scale: float | None = None,
                            schedule: str = "distflash", backend="auto", overlap: bool = True,
                            head_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
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
        backend: local attention backend name ("auto", "reference", "cudnn", ...; see
            :mod:`lctrain_kernels.backends`), or a Backend object standing for its name.
        overlap: post the next step's transfers before computing the current block (False is
            the ablation that waits right after posting).
        head_groups: run the heads in this many groups, one after the other (it must divide
            Hkv): the attention's buffers (received k/v, float32 accumulators, gradients) are
            those of Hq / head_groups heads; same results.

    Returns:
        ``(out, lse)``: (B, N/P, Hq, D) in q's dtype and (B, Hq, N/P) float32 (float64 for
        float64 inputs), natural log; both differentiable with respect to q, k and v. When a
        loss uses the lse on one rank of a group, it must use it on every rank (its gradient
        travels with the query rows).

    Raises:
        ValueError: bad shapes, dtypes, schedule name, cu_seqlens, scale, head_groups, or a
            global length (P × local length) not divisible by the schedule's layout chunking.
        BackendUnavailable: the backend is unknown, not installed, or cannot run a block.
    """
    _check_tensors(q, k, v)
    options = op_options(q, k, group, causal, cu_seqlens, softmax_scale, schedule, backend,
                         overlap, head_groups)
    return torch.ops.lctrain.dist_attention(q, k, v, *options)


def dist_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   cu_seqlens=None, softmax_scale: float | None = None, schedule: str = "distflash",
                   backend="auto", overlap: bool = True, head_groups: int = 1) -> torch.Tensor:
    """Sequence-parallel attention of this rank's rows; see :func:`dist_attention_with_lse`.

    Returns:
        (B, N/P, Hq, D) output rows of this rank, in q's dtype, differentiable.

    Raises:
        ValueError, BackendUnavailable: as :func:`dist_attention_with_lse`.
    """
    return dist_attention_with_lse(q, k, v, group, causal, cu_seqlens, softmax_scale, schedule,
                                   backend, overlap, head_groups)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                       cu_seqlens=None, softmax_scale: float | None = None, backend="auto",
                       head_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a whole sequence on one device, with its log-sum-exp.

    Args:
        q: (B, S, Hq, D) queries.
        k: (B, S, Hkv, D) keys; ``Hq % Hkv == 0`` (GQA/MQA without repeating K/V).
        v: (B, S, Hkv, D) values.
        causal: key ``j`` is visible to query ``i`` only if ``j <= i``.
        cu_seqlens: packed documents as int boundaries ``[0, ..., S]`` (tensor or list), the
            same for every batch row; attention never crosses a document. None: one document.
        softmax_scale: scale of ``q k^T``; default ``1 / sqrt(D)``.
        backend: "auto" (see :mod:`lctrain_kernels.backends`), a backend name, or a Backend.
        head_groups: run the heads in this many groups one after the other (a divisor of Hkv),
            bounding the kernels' transient buffers; same results.

    Returns:
        ``(out, lse)``: (B, S, Hq, D) in q's dtype and (B, Hq, S) float32 (float64 for
        float64 inputs), natural log. Both are differentiable with respect to q, k and v.

    Raises:
        ValueError: on inconsistent shapes, dtypes, devices, ``cu_seqlens`` or scale.
        BackendUnavailable: if the requested backend cannot run this attention.
    """
    return dist_attention_with_lse(q, k, v, None, causal, cu_seqlens, softmax_scale,
                                   backend=backend, head_groups=head_groups)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              cu_seqlens=None, softmax_scale: float | None = None, backend="auto",
              head_groups: int = 1) -> torch.Tensor:
    """Attention of a whole sequence on one device; see :func:`attention_with_lse`.

    Returns:
        (B, S, Hq, D) output in q's dtype, differentiable with respect to q, k and v.

    Raises:
        ValueError: on inconsistent shapes, dtypes, devices, ``cu_seqlens`` or scale.
        BackendUnavailable: if the requested backend cannot run this attention.
    """
    return attention_with_lse(q, k, v, causal, cu_seqlens, softmax_scale, backend,
                              head_groups)[0]
