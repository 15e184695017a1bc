"""Merging partial attention results through their log-sum-exp.

Attention over a set of keys splits into attention over disjoint pieces of it. For one query
row, a piece ``a`` gives its normalised output ``out_a`` and ``lse_a = log sum_j exp(s_j)``
over its keys. Two pieces combine exactly into the attention over their union:

    lse = log(exp(lse_a) + exp(lse_b)) = max(lse_a, lse_b) + log1p(exp(-|lse_a - lse_b|))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Both weights are at most 1, so nothing overflows; the arithmetic is float32 (float64 when the
inputs are float64, so the float64 oracle tests keep their precision). A row that sees
no key in a piece carries ``lse = -inf`` and ``out = 0``: its weight is exactly 0. A row that
sees no key in either piece stays ``lse = -inf``, ``out = 0`` (never NaN). This is how
DistFlashAttn folds the blocks computed on other workers into the owner's result.
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


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


def _check(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"cannot merge partial results of different shapes: out "
                         f"{tuple(out_a.shape)} vs {tuple(out_b.shape)}, lse "
                         f"{tuple(lse_a.shape)} vs {tuple(lse_b.shape)}.")
    b, s, h, _ = out_a.shape
    if tuple(lse_a.shape) != (b, h, s):
        raise ValueError(f"lse must be (B, H, S) = {(b, h, s)} for out of shape (B, S, H, D) = "
                         f"{tuple(out_a.shape)}, got {tuple(lse_a.shape)}.")


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """Fold one partial result into a float32 accumulator, in place.

    Args:
        acc_out: (B, S, H, D) float32 running output, updated in place.
        acc_lse: (B, H, S) float32 running log-sum-exp, updated in place (start at -inf
            with ``acc_out`` zero for an empty accumulator).
        out: (B, S, H, D) partial output of the same rows, any float dtype.
        lse: (B, H, S) its log-sum-exp.

    Raises:
        ValueError: if the shapes disagree or the accumulator is not float32.
    """
    _check(acc_out, acc_lse, out, lse)
    wide = (torch.float32, torch.float64)
    if acc_out.dtype not in wide or acc_lse.dtype not in wide:
        raise ValueError(f"the merge accumulator must be float32 (or float64), got out "
                         f"{acc_out.dtype} and lse {acc_lse.dtype}.")
    from lctrain_kernels.combine import merge_many_into  # combine builds on merge below

    merge_many_into(acc_out, acc_lse, [(acc_out, acc_lse), (out, lse)])  # one kernel on CUDA


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
    _check(out_a, lse_a, out_b, lse_b)
    lse, w_a, w_b = _weights(lse_a, lse_b)
    ct = torch.promote_types(torch.promote_types(out_a.dtype, out_b.dtype), lse.dtype)
    out = out_a.to(ct) * _as_bshd_weight(w_a).to(ct) + out_b.to(ct) * _as_bshd_weight(w_b).to(ct)
    return out, lse
