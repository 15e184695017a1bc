"""The local attention API: ``attention`` and ``attention_with_lse`` on one device.

Layout is BSHD — q ``(B, S, Hq, D)``, k and v ``(B, S, Hkv, D)`` with ``Hq % Hkv == 0`` — and the
log-sum-exp is ``(B, Hq, S)`` float32 (float64 for float64 inputs), natural log. The whole sequence is ONE block of
:mod:`lctrain_kernels.blocks` (queries and keys both start at global position 0), so the local
path and the distributed one run exactly the same backends.

Autograd: a :class:`torch.autograd.Function` saves q, k, v, out and lse (no score matrix) and its
backward recomputes the probabilities through ``block_backward``, as FlashAttention does. The
log-sum-exp is differentiable too: ``d lse_i / d s_ij = P_ij``, which is exactly the
``dS = P * (dP - delta)`` of an ordinary backward run with ``dO_i = g_i e_0``, ``V_j = e_0`` and
``O = 0`` (so ``dP_ij = g_i`` and ``delta = 0``); that second backward runs only when a loss
actually uses the lse.
"""
from __future__ import annotations

import math

import torch

from lctrain_kernels.blocks import block_backward, block_forward
from lctrain_kernels.masks import MaskSpec, doc_bounds_from

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    return torch.zeros_like(q), lse


def _lse_backward(dlse, q, k, v, out, lse, spec, scale, backend):
    """(dq, dk, _) of ``sum(dlse * lse)`` via one ordinary backward (see module docstring)."""
    do_unit = torch.zeros_like(q)  # (B, S, Hq, D): dlse in feature 0
    do_unit[..., 0] = dlse.transpose(1, 2).to(q.dtype)
    v_unit = torch.zeros_like(v)  # (B, S, Hkv, D): e_0 for every key
    v_unit[..., 0] = 1
    return block_backward(do_unit, q, k, v_unit, torch.zeros_like(out), lse, spec, scale=scale,
                          backend=backend)


class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: MaskSpec, scale: float, backend):
        result = block_forward(q, k, v, spec, scale=scale, backend=backend)
        out, lse = result if result is not None else _empty_result(q)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.scale, ctx.backend = spec, scale, backend
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        spec, scale, backend = ctx.spec, ctx.scale, ctx.backend
        grads = None  # (dq (B, S, Hq, D), dk (B, S, Hkv, D), dv (B, S, Hkv, D))
        if dout is not None:
            grads = block_backward(dout.contiguous(), q, k, v, out, lse, spec, scale=scale,
                                   backend=backend)
        if dlse is not None:
            extra = _lse_backward(dlse, q, k, v, out, lse, spec, scale, backend)
            if extra is not None:
                extra = (extra[0], extra[1], torch.zeros_like(v))  # lse does not depend on v
                grads = extra if grads is None else _add_wide(grads, extra)
        if grads is None:  # empty attention or no gradient flowing in
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None
        dq, dk, dv = grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _add_wide(a, b):
    """Element-wise sums of two gradient triples, in float32 at least."""
    return tuple(x.to(torch.promote_types(x.dtype, torch.float32)) + y for x, y in zip(a, b))


def _check_tensors(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seq, heads, head_dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t)}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}.")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must share batch and sequence length (self-attention), got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}.")
    if q.shape[3] != k.shape[3] or q.shape[3] == 0:
        raise ValueError(f"q and k/v must have the same non-zero head_dim, got {q.shape[3]} and "
                         f"{k.shape[3]}.")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"the number of query heads ({q.shape[2]}) must be a multiple of the "
                         f"number of key/value heads ({k.shape[2]}).")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k and v must share one float dtype (float16, bfloat16, float32 or "
                         f"float64), got {q.dtype}, {k.dtype} and {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and "
                         f"{v.device}.")


def _spec_and_scale(q, causal, cu_seqlens, softmax_scale) -> tuple[MaskSpec, float]:
    bounds = doc_bounds_from(cu_seqlens)
    if bounds is not None and bounds[-1] != q.shape[1]:
        raise ValueError(f"cu_seqlens must end at the sequence length {q.shape[1]}, got "
                         f"{bounds[-1]}.")
    scale = 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}.")
    return MaskSpec(causal=bool(causal), doc_bounds=bounds), scale


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                       cu_seqlens=None, softmax_scale: float | None = None, backend="auto"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
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

    Returns:
        ``(out, lse)``: (B, S, Hq, D) in q's dtype and (B, Hq, S) float32 (float64 for
        float64 inputs), natural log. Both are differentiable with respect to q, k and v.

    Raises:
        ValueError: on inconsistent shapes, dtypes, devices, ``cu_seqlens`` or scale.
        BackendUnavailable: if the requested backend cannot run this attention.
    """
    _check_tensors(q, k, v)
    spec, scale = _spec_and_scale(q, causal, cu_seqlens, softmax_scale)
    return _AttentionFn.apply(q, k, v, spec, scale, backend)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              cu_seqlens=None, softmax_scale: float | None = None, backend="auto"
              ) -> torch.Tensor:
    """Attention of a whole sequence on one device; see :func:`attention_with_lse`.

    Returns:
        (B, S, Hq, D) output in q's dtype, differentiable with respect to q, k and v.

    Raises:
        ValueError: on inconsistent shapes, dtypes, devices, ``cu_seqlens`` or scale.
        BackendUnavailable: if the requested backend cannot run this attention.
    """
    return attention_with_lse(q, k, v, causal, cu_seqlens, softmax_scale, backend)[0]
