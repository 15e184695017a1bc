"""How docsplit's calls read the block's rows and write their results back.

A dense call of a plan (:class:`lctrain_kernels.docsplit.DenseCall`) reads its entries as
VIEWS of the block where it can (:func:`batch`: ``n`` adjacent rows of ``L`` as ``(n, L, ...)``)
and otherwise gathers them (:func:`gather`, with the indices of :func:`gather_index`, built once
per call and device). Results go to :class:`Rows`: straight into the block's result tensors
when one call computes the rows, kept and combined once at the end (merged through the lse,
gradients summed, in float32) where several do; rows nobody computes get out = 0, lse = -inf,
zero gradients. A padded square's borrowed rows get lse = +inf in the backward
(:func:`batch_lse`, :func:`gather_lse`): ``exp(s - lse)`` is then exactly 0 there.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from lctrain_kernels.combine import merge_many_into, sum_into
from lctrain_kernels.docsplit import DenseCall, PackedCall

_INF = float("inf")


class Index(NamedTuple):
    """Device indices of a gathered call: rows read into the batch (clamped to the block),
    positions of its real rows in the batch (None: all are real) and their block rows, for
    queries and for keys; ``pad``: (n, sq) bool, the borrowed rows (None: none)."""

    q: torch.Tensor
    k: torch.Tensor
    src_q: torch.Tensor | None
    dst_q: torch.Tensor
    src_k: torch.Tensor | None
    dst_k: torch.Tensor
    pad: torch.Tensor | None


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index on ``device`` without stalling the host (pinned, asynchronous copy)."""
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


@functools.lru_cache(maxsize=256)
def gather_index(call: DenseCall, sq: int, sk: int, device: torch.device) -> Index:
    """The indices of a gathered dense call (built once per call and device, then cached)."""
    tq, tk = torch.arange(call.sq), torch.arange(call.sk)
    q = torch.cat([(a + tq).clamp_(max=sq - 1) for a in call.q0])
    k = torch.cat([(a + tk).clamp_(max=sk - 1) for a in call.k0])
    real_q = torch.cat([tq < r for r in call.rows])  # (n*sq,)
    real_k = torch.cat([tk < call.keys(i) for i in range(call.n)])
    src_q, src_k = real_q.nonzero().flatten(), real_k.nonzero().flatten()
    return Index(to_device(q, device), to_device(k, device),
                  to_device(src_q, device) if call.padded else None, to_device(q[src_q], device),
                  to_device(src_k, device) if call.padded else None, to_device(k[src_k], device),
                  to_device(~real_q.view(call.n, call.sq), device) if call.padded else None)


@functools.lru_cache(maxsize=64)
def packed_index(call: PackedCall, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block rows of the packed call's queries and keys, in packed order."""
    q = torch.cat([torch.arange(a, a + n) for a, n in zip(call.q0, call.n)])
    k = torch.cat([torch.arange(a, a + n) for a, n in zip(call.k0, call.n)])
    return to_device(q, device), to_device(k, device)


def batch(x: torch.Tensor, start: int, n: int, length: int) -> torch.Tensor:
    """Rows ``start ... start + n*length`` of x as a batch (B*n, length, ...): a view (the
    caller checks :func:`viewable`)."""
    part = x[:, start:start + n * length]  # (B, n*length, ...)
    return part if n == 1 else part.view(x.shape[0] * n, length, *x.shape[2:])


def batch_lse(lse: torch.Tensor, start: int, n: int, length: int, pad_from: int | None = None):
    """The lse (B, H, S) of the same rows as (B*n, H, length); with ``pad_from``, a copy whose
    rows from there on are +inf (a padded square's borrowed rows)."""
    b, h, _ = lse.shape
    part = lse[:, :, start:start + n * length]  # (B, H, n*length)
    if n > 1:
        return part.reshape(b, h, n, length).transpose(1, 2).reshape(b * n, h, length)
    if pad_from is not None and pad_from < length:
        part = part.clone()
        part[:, :, pad_from:] = _INF
    return part


def gather(x: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``index`` of x (B, S, ...) as a batch (B*n, len(index)/n, ...)."""
    g = x.index_select(1, index)  # (B, n*L, ...)
    return g.view(x.shape[0] * n, -1, *x.shape[2:])


def gather_lse(lse: torch.Tensor, index: torch.Tensor, n: int, pad=None) -> torch.Tensor:
    """Columns ``index`` of an lse (B, H, S) as (B*n, H, L); ``pad`` (n, L) rows set to +inf."""
    b, h, _ = lse.shape
    g = lse.index_select(2, index).view(b, h, n, -1)  # (B, H, n, L)
    if pad is not None:
        g = g.masked_fill(pad, _INF)
    return g.transpose(1, 2).reshape(b * n, h, -1)


def unbatch(x: torch.Tensor, b: int) -> torch.Tensor:
    """(B*n, L, ...) -> (B, n*L, ...)."""
    return x.reshape(b, -1, *x.shape[2:])


def unbatch_lse(lse: torch.Tensor, b: int) -> torch.Tensor:
    """(B*n, H, L) -> (B, H, n*L)."""
    bn, h, length = lse.shape
    return lse.reshape(b, bn // b, h, length).transpose(1, 2).reshape(b, h, -1)


def select(x: torch.Tensor, index: torch.Tensor | None, dim: int) -> torch.Tensor:
    return x if index is None else x.index_select(dim, index)


def viewable(x: torch.Tensor, n: int, length: int) -> bool:
    """Whether n adjacent pieces of ``length`` rows of x view as one batch (B = 1, or the
    pieces hold all of x's rows)."""
    return n == 1 or x.shape[0] == 1 or x.stride(0) == n * length * x.stride(1)


def view_runs(call: DenseCall, rows: list[torch.Tensor], keys: list[torch.Tensor]):
    """(first entry, count) of each view call that runs ``call``: all its entries at once,
    or (a batch that cannot be a view of every tensor, B > 1) one entry at a time."""
    if (all(viewable(t, call.n, call.sq) for t in rows)
            and all(viewable(t, call.n, call.sk) for t in keys)):
        return [(0, call.n)]
    return [(i, 1) for i in range(call.n)]


class Rows:
    """The block's result tensors of one side (query rows: out and lse, or dq; key rows: dk
    and dv), filled call by call: rows that one call computes are written at once; parts of
    calls that share rows are kept and combined once in :meth:`finish`."""

    def __init__(self, dsts: tuple[torch.Tensor, ...], dims: tuple[int, ...], shared, merge):
        self.dsts, self.dims, self.shared, self.merge = dsts, dims, shared, merge
        self.parts: list[tuple[int, int, tuple[torch.Tensor, ...]]] = []
        self.unset: list[tuple[int, int]] = []  # rows of shared calls that saw nothing

    def _narrow(self, tensors, a: int, n: int) -> list[torch.Tensor]:
        return [t.narrow(dim, a, n) for t, dim in zip(tensors, self.dims)]

    def put(self, call: int, a: int, b: int, parts: tuple[torch.Tensor, ...]) -> None:
        """Call ``call``'s result for rows ``[a, b)``."""
        if call in self.shared:
            self.parts.append((a, b, parts))
            return
        for dst, src in zip(self._narrow(self.dsts, a, b - a), parts):
            dst.copy_(src)

    def nothing(self, call: int, a: int, b: int) -> None:
        """Call ``call`` sees no pair in rows ``[a, b)`` (skipped)."""
        if call in self.shared:
            self.unset.append((a, b))
        else:
            self.identity(a, b)

    def scatter(self, index: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> None:
        """Rows ``index`` of a gathered call (never shared: the plan gathers whole documents)."""
        for dst, dim, src in zip(self.dsts, self.dims, parts):
            dst.index_copy_(dim, index, src.to(dst.dtype))

    def identity(self, a: int, b: int) -> None:
        """Rows ``[a, b)`` that no call computes: out 0 and lse -inf, or zero gradients."""
        for i, t in enumerate(self._narrow(self.dsts, a, b - a)):
            t.fill_(-_INF if self.merge and i == 1 else 0)

    def finish(self, free) -> tuple[torch.Tensor, ...]:
        """Combine the shared parts, fill the rows nobody computed; the result tensors."""
        cuts = sorted({x for a, b, _ in self.parts for x in (a, b)}
                      | {x for r in self.unset for x in r})
        for lo, hi in zip(cuts, cuts[1:]):
            covering = [self._narrow(ts, lo - a, hi - lo) for a, b, ts in self.parts
                        if a <= lo and hi <= b]
            target = self._narrow(self.dsts, lo, hi - lo)
            if len(covering) == 1:
                for d, s in zip(target, covering[0]):
                    d.copy_(s)
            elif covering and self.merge:
                merge_many_into(target[0], target[1], [tuple(c) for c in covering])
            elif covering:
                for j, d in enumerate(target):
                    sum_into(d, [c[j] for c in covering])
            elif any(a <= lo and hi <= b for a, b in self.unset):
                self.identity(lo, hi)
        for a, b in free:
            self.identity(a, b)
        return self.dsts


class Keep:
    """Takes the one result of a plan whose single view call computes the whole block."""

    def __init__(self):
        self.parts: tuple[torch.Tensor, ...] = ()

    def put(self, call: int, a: int, b: int, parts: tuple[torch.Tensor, ...]) -> None:
        self.parts = parts
