"""Combine any number of partial results of the same rows: gradient sums and output merges.

``sum_into(dst, parts)`` writes ``sum(parts)``; ``merge_many_into(dst, dst_lse, parts)`` writes
the attention over the union of the parts' key sets (see :mod:`lctrain_kernels.merge` for the
arithmetic). Both compute in float32 (float64 when an input is float64) and round ONCE into
``dst``, however many parts there are — a bf16 gradient summed from three blocks is as exact
as the blocks themselves allow. On CUDA with contiguous head dims one Triton kernel
(:mod:`lctrain_kernels.triton.combine`) reads each part once per group of four; elsewhere
(CPU, float64, odd strides) the same arithmetic runs as torch ops. ``dst`` may be one of the
parts (an in-place fold).
"""
from __future__ import annotations

import torch

from lctrain_kernels.merge import merge

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
