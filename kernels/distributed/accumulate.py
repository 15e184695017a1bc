"""Accumulators for the rows of one rank: partial outputs (merged) and gradients (summed).

A block's result covers a run of rows. The first result to reach a row is copied in, later
ones are merged (outputs, through their lse: :func:`lctrain_kernels.merge.merge_into`) or
added (gradients) in float32. When a single result covers every row and nothing else comes,
it is kept as it is — no float32 buffer, no copy (one rank, or a block computed whole). Rows
that nothing reaches read out = 0 and lse = -inf, or a zero gradient.
"""
from __future__ import annotations

import torch

from lctrain_kernels.merge import merge_into


class _Touched:
    """The row intervals of ``[0, n)`` that already hold data."""

    def __init__(self, n: int):
        self.n, self.spans = n, []

    def untouched(self, a: int, b: int) -> list[tuple[int, int]]:
        """Sub-intervals of ``[a, b)`` that hold nothing yet."""
        gaps, lo = [], a
        for s, e in sorted(self.spans):
            if e <= lo or s >= b:
                continue
            if s > lo:
                gaps.append((lo, s))
            lo = max(lo, e)
        if lo < b:
            gaps.append((lo, b))
        return gaps

    def mark(self, a: int, b: int) -> None:
        self.spans.append((a, b))


class OutAcc:
    """Output rows (B, n, H, D) and their lse (B, H, n) of one rank or one helped block."""

    def __init__(self, n: int):
        self.n, self.out, self.lse, self.fp32 = n, None, None, False
        self.touched = _Touched(n)

    def _widen(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        bsz, _, h, dim = out.shape
        acc_out = out.new_empty((bsz, self.n, h, dim), dtype=torch.float32)  # (B, n, H, D)
        acc_lse = lse.new_empty((bsz, h, self.n), dtype=torch.float32)  # (B, H, n)
        if self.out is not None:
            acc_out.copy_(self.out)
            acc_lse.copy_(self.lse)
        self.out, self.lse, self.fp32 = acc_out, acc_lse, True

    def add(self, a: int, b: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Fold a partial result of rows ``[a, b)``: out (B, b−a, H, D), lse (B, H, b−a)."""
        if self.out is None and (a, b) == (0, self.n):
            self.out, self.lse = out, lse
            self.touched.mark(a, b)
            return
        if not self.fp32:
            self._widen(out, lse)
        gaps = self.touched.untouched(a, b)
        if gaps == [(a, b)]:  # first result for all these rows: copy
            self.out[:, a:b].copy_(out)
            self.lse[:, :, a:b].copy_(lse)
        else:
            for s, e in gaps:
                self.out[:, s:e].zero_()
                self.lse[:, :, s:e].fill_(float("-inf"))
            merge_into(self.out[:, a:b], self.lse[:, :, a:b], out, lse)
        self.touched.mark(a, b)

    def result(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in like.dtype (B, n, H, D), lse float32 (B, H, n))."""
        if self.out is None:
            bsz, _, h, _ = like.shape
            lse = like.new_full((bsz, h, self.n), float("-inf"), dtype=torch.float32)
            return torch.zeros_like(like), lse
        for s, e in self.touched.untouched(0, self.n):
            self.out[:, s:e].zero_()
            self.lse[:, :, s:e].fill_(float("-inf"))
        return self.out.to(like.dtype), self.lse


class GradAcc:
    """Gradient rows (B, n, H, D), summed in float32 once a second contribution arrives."""

    def __init__(self, n: int):
        self.n, self.grad, self.fp32 = n, None, False
        self.touched = _Touched(n)

    def add(self, a: int, b: int, grad: torch.Tensor) -> None:
        """Add the gradient (B, b−a, H, D) of rows ``[a, b)``."""
        if self.grad is None and (a, b) == (0, self.n):
            self.grad = grad
            self.touched.mark(a, b)
            return
        if not self.fp32:
            bsz, _, h, dim = grad.shape
            acc = grad.new_empty((bsz, self.n, h, dim), dtype=torch.float32)  # (B, n, H, D)
            if self.grad is not None:
                acc.copy_(self.grad)
            self.grad, self.fp32 = acc, True
        gaps = self.touched.untouched(a, b)
        if gaps == [(a, b)]:
            self.grad[:, a:b].copy_(grad)
        else:
            for s, e in gaps:
                self.grad[:, s:e].zero_()
            self.grad[:, a:b] += grad
        self.touched.mark(a, b)

    def result(self, like: torch.Tensor) -> torch.Tensor:
        """The summed gradient in like.dtype, (B, n, H, D)."""
        if self.grad is None:
            return torch.zeros_like(like)
        for s, e in self.touched.untouched(0, self.n):
            self.grad[:, s:e].zero_()
        return self.grad.to(like.dtype)
