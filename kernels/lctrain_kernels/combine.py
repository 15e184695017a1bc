"""Combining partial attention results of the same rows, and the accumulators of one rank.

Attention over a set of keys splits exactly into attention over disjoint pieces of it. Per query
row, piece ``a`` gives its normalised ``out_a`` and ``lse_a = log sum_j exp(s_j)``; two pieces
combine into the attention over their union::

    lse = max(lse_a, lse_b) + log1p(exp(-|lse_a - lse_b|))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

A piece in which a row sees nothing has ``lse = -inf`` and weight exactly 0 (never NaN). Math is
float32 (float64 when an input is), rounded ONCE into the destination; on CUDA one Triton kernel
reads each part once. :class:`OutAcc` and :class:`GradAcc` keep a rank's results as they come and
combine them once, when read out, folding them into a float32 base when they hold too much."""
from __future__ import annotations

import functools

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


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results (out (B, S, H, D), lse (B, H, S)) of the same rows over disjoint
    keys, merged into new float32 (float64) tensors; ValueError for shapes that disagree."""
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
    w_a, w_b = (w.transpose(1, 2).unsqueeze(-1).to(ct) for w in (w_a, w_b))  # (B, S, H, 1)
    out = out_a.to(ct) * w_a + out_b.to(ct) * w_b
    return out, lse


def _wide(dtypes) -> torch.dtype:
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


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
    """``dst[...] = sum(parts)`` for (B, S, H, D) tensors, in float32 (float64), rounded once."""
    _check(dst, parts)
    wide = _wide([dst.dtype] + [p.dtype for p in parts])
    if wide == torch.float32 and _fusable([dst, *parts]):
        from lctrain_kernels.triton.merge import MAX_INPUTS, sum_fused

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
    """Merge partial ``(out, lse)`` pairs over disjoint keys into ``dst`` and ``dst_lse``."""
    _check(dst, [o for o, _ in parts])
    for _, lse in parts:
        if lse.shape != dst_lse.shape:
            raise ValueError(f"cannot merge an lse of shape {tuple(lse.shape)} into "
                             f"{tuple(dst_lse.shape)}.")
    tensors = [dst, dst_lse, *(t for pair in parts for t in pair)]
    if _wide(t.dtype for t in tensors) == torch.float32 and _fusable(tensors):
        from lctrain_kernels.triton.merge import MAX_INPUTS, merge_fused

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


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The lse dtype of inputs of ``dtype``: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Rows:
    """Results for runs of ``[0, n)``: tuples of tensors with rows along ``row_dims``."""

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
