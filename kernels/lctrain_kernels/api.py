"""The one door into the kernels: attention, the fused layer kernels, and what the benches use.

Local attention IS distributed attention on a group of one: the four attention functions check their
arguments here, once, on the host, and call the one operator ``torch.ops.lctrain.dist_attention``
(:mod:`lctrain_kernels.distributed.op`). Layout is BSHD: q ``(B, S, Hq, D)``, k and v
``(B, S, Hkv, D)`` with ``Hq % Hkv == 0``; the lse is ``(B, Hq, S)`` float32 (float64 for float64
inputs), natural log. The block kernels (:mod:`lctrain_kernels.fused`) load Triton on first use."""
from __future__ import annotations

import importlib

import torch

from lctrain_kernels.backends import (BackendUnavailable, auto_order, available_backends,
                                      block_forward, get_backend)
from lctrain_kernels.combine import merge
from lctrain_kernels.distributed.op import op_options
from lctrain_kernels.masks import MaskSpec, Relation, classify
from lctrain_kernels.reference import reference_backward, reference_forward

__all__ = [
    "BackendUnavailable", "MaskSpec", "Relation", "attention", "attention_block",
    "attention_with_lse", "auto_order", "available_backends", "block_forward",
    "chunked_cross_entropy", "classify", "dist_attention", "dist_attention_with_lse",
    "dotted_version", "get_backend", "merge", "reference_backward", "reference_forward",
    "rotate_tokens", "tiled_apply",
]

_LAZY = {"rotate_tokens": "fused.rope", "chunked_cross_entropy": "loss",
         "attention_block": "fused.block", "tiled_apply": "tiled",
         "dotted_version": "backends.cudnn_ragged"}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def __getattr__(name: str):
    """The fused kernels and what loads Triton, imported on first use (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(f"lctrain_kernels.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'lctrain_kernels.api' has no attribute {name!r}")


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


def dist_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                            causal: bool = True, cu_seqlens=None, softmax_scale: float | None = None,
                            schedule: str = "distflash", backend="auto", overlap: bool = True,
                            head_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-parallel attention of this rank's rows, with their global log-sum-exp.

    Args:
        q: (B, N/P, Hq, D) this rank's queries, sharded with ``make_schedule(P, schedule).layout``.
        k, v: (B, N/P, Hkv, D) this rank's keys and values, ``Hq % Hkv == 0``.
        group: the sequence-parallel process group; None (or one rank) runs local attention.
        causal: key ``j`` visible to query ``i`` only if ``j <= i`` (global positions).
        cu_seqlens: GLOBAL document bounds ``[0, ..., N]`` (tensor or ints, identical on every
            rank); attention never crosses a document. None: one document.
        softmax_scale: scale of ``q k^T``; default ``1 / sqrt(D)``.
        schedule: "distflash" (balanced, default), "ring" or "zigzag".
        backend: "auto", a backend name (:mod:`lctrain_kernels.backends`) or a Backend.
        overlap: post the next step's transfers before computing the current block.
        head_groups: run the heads in this many groups one after the other (a divisor of Hkv),
            so the buffers hold Hq / head_groups heads; same results.

    Returns:
        ``(out, lse)``: (B, N/P, Hq, D) in q's dtype and (B, Hq, N/P) float32 (float64 for
        float64 inputs); both differentiable. A loss that uses the lse on one rank of a group
        must use it on every rank.

    Raises:
        ValueError: bad shapes, dtypes, schedule, cu_seqlens, scale, head_groups, or a global
            length not divisible by the schedule's layout chunking.
        BackendUnavailable: the backend is unknown, not installed, or cannot run a block.
    """
    _check_tensors(q, k, v)
    options = op_options(q, k, group, causal, cu_seqlens, softmax_scale, schedule, backend,
                         overlap, head_groups)
    return torch.ops.lctrain.dist_attention(q, k, v, *options)


def dist_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, causal: bool = True,
                   cu_seqlens=None, softmax_scale: float | None = None, schedule: str = "distflash",
                   backend="auto", overlap: bool = True, head_groups: int = 1) -> torch.Tensor:
    """The output (B, N/P, Hq, D) of :func:`dist_attention_with_lse` (same arguments)."""
    return dist_attention_with_lse(q, k, v, group, causal, cu_seqlens, softmax_scale, schedule,
                                   backend, overlap, head_groups)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                       cu_seqlens=None, softmax_scale: float | None = None, backend="auto",
                       head_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a whole sequence on one device, with its log-sum-exp: q (B, S, Hq, D),
    k and v (B, S, Hkv, D), ``cu_seqlens`` ``[0, ..., S]`` the same for every batch row; the
    arguments, results and errors of :func:`dist_attention_with_lse` on a group of one."""
    return dist_attention_with_lse(q, k, v, None, causal, cu_seqlens, softmax_scale,
                                   backend=backend, head_groups=head_groups)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              cu_seqlens=None, softmax_scale: float | None = None, backend="auto",
              head_groups: int = 1) -> torch.Tensor:
    """The output (B, S, Hq, D) of :func:`attention_with_lse` (same arguments)."""
    return attention_with_lse(q, k, v, causal, cu_seqlens, softmax_scale, backend, head_groups)[0]
