"""Accumulators for the rows of one rank: partial outputs (merged) and gradients (summed).

A block's result covers a run of rows ``[a, b)`` of ``[0, n)``. Results are KEPT as they come
(no copy) and combined once, when the rank reads the accumulator out: for every run of rows
between result boundaries, the results that cover it are merged (outputs, through their lse)
or summed (gradients) by :mod:`lctrain_kernels.combine` in float32 and rounded once into the
output dtype. Against an eager float32 accumulator (widen, add each result, cast) this moves a
quarter of the bytes — at 64K tokens over 2 GPUs those passes were 5 % of the step — and
rows that one result reaches are a plain copy, one result covering every row no copy at all.

Memory stays what the eager scheme needed: while the results held exceed a float32
accumulator of ``n`` rows plus one result of ``n`` rows, they are folded into a float32 base
(itself kept and combined like a result). Rows that nothing reaches read out = 0 and
lse = -inf, or a zero gradient.
"""
from __future__ import annotations

import torch

from lctrain_kernels.combine import merge_many_into, sum_into


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The lse dtype of inputs of ``dtype``: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Rows:
    """Results for runs of ``[0, n)`` (tuples of tensors, row dim given by ``row_dims``)."""

    row_dims: tuple[int, ...]  # per tensor of a result, the dimension that holds the rows

    def __init__(self, n: int):
        self.n = n
        self.parts: list[tuple[int, int, tuple[torch.Tensor, ...]]] = []
        self.base: tuple[torch.Tensor, ...] | None = None  # float32, all n rows (0 / -inf if none)

    def _add(self, a: int, b: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.parts.append((a, b, tensors))
        one = _nbytes(tensors) * self.n // max(b - a, 1)  # one result of n rows
        wide = sum(t.numel() * self.n // max(b - a, 1) * 4 for t in tensors)  # float32, n rows
        held = _nbytes(t for _, _, ts in self.parts for t in ts) + _nbytes(self.base or ())
        if held > wide + one:
            self._fold()

    def _slice(self, tensors, lo: int, hi: int) -> list[torch.Tensor]:
        return [t.narrow(dim, lo, hi - lo) for t, dim in zip(tensors, self.row_dims)]

    def _segments(self):
        """(lo, hi, [tensors of each result covering [lo, hi)]) for consecutive runs of rows."""
        cuts = sorted({0, self.n} | {x for a, b, _ in self.parts for x in (a, b)})
        for lo, hi in zip(cuts, cuts[1:]):
            covering = [self._slice(self.base, lo, hi)] if self.base is not None else []
            covering += [self._slice(ts, lo - a, hi - a) for a, b, ts in self.parts if a <= lo and hi <= b]
            yield lo, hi, covering

    def _write(self, dst: tuple[torch.Tensor, ...]) -> None:
        """Combine everything held into ``dst`` (n rows); empty runs get the identity."""
        for lo, hi, covering in self._segments():
            target = self._slice(dst, lo, hi)
            if not covering:
                self.identity(target)
            elif len(covering) == 1:
                for d, s in zip(target, covering[0]):
                    if d.data_ptr() != s.data_ptr():
                        d.copy_(s)
            else:
                self.combine(target, covering)

    def _fold(self) -> None:
        """Combine every result held into the float32 base (allocated on first use)."""
        if self.base is None:  # the first fold: a fresh buffer, every row written below
            base = tuple(self._alloc(t, dim, torch.promote_types(t.dtype, torch.float32))
                         for t, dim in zip(self.parts[0][2], self.row_dims))
            self._write(base)
            self.base = base
        else:  # later folds add into the base in place (it covers every row)
            self._write(self.base)
        self.parts = []

    def _alloc(self, like: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
        shape = list(like.shape)
        shape[dim] = self.n
        return like.new_empty(shape, dtype=dtype)

    def _read(self, dtypes: tuple[torch.dtype, ...]) -> tuple[torch.Tensor, ...] | None:
        """Everything combined into fresh tensors of ``dtypes``; None if nothing was added."""
        if self.base is None and not self.parts:
            return None
        if self.base is None and len(self.parts) == 1 and self.parts[0][:2] == (0, self.n):
            return tuple(t.to(dt) for t, dt in zip(self.parts[0][2], dtypes))  # kept as it is
        like = self.base if self.base is not None else self.parts[0][2]
        dst = tuple(self._alloc(t, dim, dt) for t, dim, dt in zip(like, self.row_dims, dtypes))
        self._write(dst)
        return dst

    # Hooks: identity(tensors) fills empty rows, combine(dst_tensors, [result tensors, ...]).


class OutAcc(_Rows):
    """Output rows (B, n, H, D) and their lse (B, H, n) of one rank or one helped block."""

    row_dims = (1, 2)

    def add(self, a: int, b: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Keep a partial result of rows ``[a, b)``: out (B, b−a, H, D), lse (B, H, b−a)."""
        self._add(a, b, (out, lse))

    def identity(self, tensors) -> None:
        tensors[0].zero_()
        tensors[1].fill_(float("-inf"))

    def combine(self, dst, covering) -> None:
        merge_many_into(dst[0], dst[1], [tuple(c) for c in covering])

    def result(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in like.dtype (B, n, H, D), lse (B, H, n) in ``lse_dtype(like.dtype)``)."""
        got = self._read((like.dtype, lse_dtype(like.dtype)))
        if got is None:
            bsz, _, h, _ = like.shape
            lse = like.new_full((bsz, h, self.n), float("-inf"), dtype=lse_dtype(like.dtype))
            return torch.zeros_like(like), lse
        return got


class GradAcc(_Rows):
    """Gradient rows (B, n, H, D), summed once in float32 when everything has arrived."""

    row_dims = (1,)

    def add(self, a: int, b: int, grad: torch.Tensor) -> None:
        """Keep the gradient (B, b−a, H, D) of rows ``[a, b)``."""
        self._add(a, b, (grad,))

    def identity(self, tensors) -> None:
        tensors[0].zero_()

    def combine(self, dst, covering) -> None:
        sum_into(dst[0], [c[0] for c in covering])

    def result(self, like: torch.Tensor) -> torch.Tensor:
        """The summed gradient in like.dtype, (B, n, H, D)."""
        got = self._read((like.dtype,))
        return torch.zeros_like(like) if got is None else got[0]
