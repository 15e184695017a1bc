"""Combine partial results of the same rows: attention outputs merged through their lse, and
gradient sums.

Attention over a set of keys splits into attention over disjoint pieces of it. For one query
row, a piece ``a`` gives its normalised output ``out_a`` and ``lse_a = log sum_j exp(s_j)``
over its keys. Two pieces combine exactly into the attention over their union:

    lse = log(exp(lse_a) + exp(lse_b)) = max(lse_a, lse_b) + log1p(exp(-|lse_a - lse_b|))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Both weights are at most 1, so nothing overflows. A row that sees no key in a piece carries
``lse = -inf`` and ``out = 0``: its weight is exactly 0; a row that sees no key in any piece
stays ``lse = -inf``, ``out = 0`` (never NaN). This is how DistFlashAttn folds the blocks
computed on other workers into the owner's result.

``merge(out_a, lse_a, out_b, lse_b)`` combines two pieces into new tensors;
``merge_many_into(dst, dst_lse, parts)`` writes the merge of any number of them, and
``sum_into(dst, parts)`` the sum of gradients. All compute in float32 (float64 when an input is
float64, so the float64 oracle tests keep their precision) and round ONCE into ``dst``, however
many parts there are — a bf16 gradient summed from three blocks is as exact as the blocks
themselves allow. On CUDA with contiguous head dims one Triton kernel
(:mod:`lctrain_kernels.triton.combine`) reads each part once per group of four; elsewhere
(CPU, float64, odd strides) the same arithmetic runs as torch ops. ``dst`` may be one of the
parts (an in-place fold).
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """Merged lse and the weights exp(lse_x - lse), (B, H, S) float32 or float64, -inf safe."""
    ct = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(ct), lse_b.to(ct)
    hi = torch.maximum(lse_a, lse_b)  # (B, H, S)
    lo = torch.minimum(lse_a, lse_b)
    hi_safe = torch.where(hi == _NEG_INF, torch.zeros_like(hi), hi)
    lse = hi + torch.log1p(torch.exp(lo - hi_safe))  # both -inf -> -inf + log1p(0) = -inf
    lse_safe = torch.where(lse == _NEG_INF, torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - lse_safe)  # exactly 0 where a piece saw nothing
    w_b = torch.exp(lse_b - lse_safe)
    return lse, w_a, w_b


def _as_bshd_weight(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(1, 2).unsqueeze(-1)  # (B, H, S) -> (B, S, H, 1)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial results of the same query rows into new tensors.

    Args:
        out_a: (B, S, H, D) output over the first set of keys.
        lse_a: (B, H, S) its log-sum-exp.
        out_b: (B, S, H, D) output over a disjoint second set of keys.
        lse_b: (B, H, S) its log-sum-exp.

    Returns:
        ``(out, lse)``: (B, S, H, D) and (B, H, S), float32 (float64 if any input is), the
        attention over the union of both key sets.

    Raises:
        ValueError: if the shapes disagree.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"cannot merge partial results of different shapes: out "
                         f"{tuple(out_a.shape)} vs {tuple(out_b.shape)}, lse "
                         f"{tuple(lse_a.shape)} vs {tuple(lse_b.shape)}.")
    b, s, h, _ = out_a.shape
    if tuple(lse_a.shape) != (b, h, s):
        raise ValueError(f"lse must be (B, H, S) = {(b, h, s)} for out of shape (B, S, H, D) = "
                         f"{tuple(out_a.shape)}, got {tuple(lse_a.shape)}.")
    lse, w_a, w_b = _weights(lse_a, lse_b)
    ct = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), lse.dtype)
    out = out_a.to(ct) * _as_bshd_weight(w_a).to(ct) + out_b.to(ct) * _as_bshd_weight(w_b).to(ct)
    return out, lse


def _wide(dtypes) -> torch.dtype:
    wide = torch.float32
    for dt in dtypes:
        wide = torch.promote_types(wide, dt)
    return wide


def _fusable(tensors: list[torch.Tensor]) -> bool:
    return all(t.is_cuda and t.dtype in _FUSED_DTYPES and t.stride(-1) == 1 for t in tensors)


def _check(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    if not parts:
        raise ValueError("nothing to combine: pass at least one partial result.")
    for p in parts:
        if p.shape != dst.shape:
            raise ValueError(f"cannot combine a part of shape {tuple(p.shape)} into "
                             f"{tuple(dst.shape)}: every part must cover the same rows.")


def sum_into(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """``dst[...] = sum(parts)``, accumulated in float32 (float64) and rounded once.

    Args:
        dst: (B, S, H, D) destination, any float dtype.
        parts: tensors of dst's shape.

    Raises:
        ValueError: no parts, or a part of another shape.
    """
    _check(dst, parts)
    wide = _wide([dst.dtype] + [p.dtype for p in parts])
    if wide == torch.float32 and _fusable([dst, *parts]):
        from lctrain_kernels.triton.combine import MAX_INPUTS, sum_fused

        while len(parts) > MAX_INPUTS:
            head = torch.empty(dst.shape, dtype=torch.float32, device=dst.device)  # (B, S, H, D)
            sum_fused(head, parts[:MAX_INPUTS])
            parts = [head, *parts[MAX_INPUTS:]]
        sum_fused(dst, parts)
        return
    acc = parts[0].to(wide, copy=True)  # (B, S, H, D)
    for p in parts[1:]:
        acc += p
    dst.copy_(acc)


def merge_many_into(dst: torch.Tensor, dst_lse: torch.Tensor,
                    parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Merge partial ``(out, lse)`` results of the same query rows into ``dst``, ``dst_lse``.

    Args:
        dst: (B, S, H, D) merged output, any float dtype.
        dst_lse: (B, H, S) merged natural-log lse, float32 (or float64).
        parts: pairs (out (B, S, H, D), lse (B, H, S)) over disjoint key sets.

    Raises:
        ValueError: no parts, or a part of another shape.
    """
    _check(dst, [o for o, _ in parts])
    for _, lse in parts:
        if lse.shape != dst_lse.shape:
            raise ValueError(f"cannot merge an lse of shape {tuple(lse.shape)} into "
                             f"{tuple(dst_lse.shape)}.")
    tensors = [dst, dst_lse, *(t for pair in parts for t in pair)]
    if _wide(t.dtype for t in tensors) == torch.float32 and _fusable(tensors):
        from lctrain_kernels.triton.combine import MAX_INPUTS, merge_fused

        while len(parts) > MAX_INPUTS:
            head = (torch.empty(dst.shape, dtype=torch.float32, device=dst.device),  # (B, S, H, D)
                    torch.empty(dst_lse.shape, dtype=torch.float32, device=dst.device))  # (B, H, S)
            merge_fused(*head, parts[:MAX_INPUTS])
            parts = [head, *parts[MAX_INPUTS:]]
        merge_fused(dst, dst_lse, parts)
        return
    out, lse = parts[0]
    out = out.to(_wide([out.dtype, lse.dtype]))
    for o, l in parts[1:]:
        out, lse = merge(out, lse, o, l)
    dst.copy_(out)
    dst_lse.copy_(lse)
