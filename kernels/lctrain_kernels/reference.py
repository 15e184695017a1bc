"""Plain-torch attention with log-sum-exp for any mask: the oracle, and the CPU path.

For one block (:mod:`lctrain_kernels.masks`), with ``S = scale * q k^T`` (-inf where hidden)::

    lse = logsumexp_j S      P = exp(S - lse)      out = P v

The backward recomputes P from the FINAL (merged) ``O`` and ``lse`` of the rows, as FlashAttention
does, so the gradients of a row's blocks simply add up::

    dV = P^T dO    dP = dO V^T    delta = rowsum(dO * O) - dlse    dS = P * (dP - delta)
    dQ = scale * dS K    dK = scale * dS^T Q      (dlse: the lse's gradient, d lse / d S = P)

GQA without copying K/V: the G query heads of one K/V head are extra rows, (B, Hkv, G*R, D).
Math in float32 (float64 stays), over chunks of query rows; hidden chunks are skipped."""
from __future__ import annotations

import bisect

import torch

from lctrain_kernels.combine import lse_dtype
from lctrain_kernels.masks import MaskSpec, Relation, classify, dense_mask

MAX_SCORES = 1 << 24  # score elements (B * Hq * rows * Sk) held at once: 64 MiB in float32
MAX_ROWS = 256  # query rows per chunk at most, so causal/document chunks skip hidden keys


def _visible_keys(spec: MaskSpec, q0: int, q1: int, sk: int) -> tuple[int, int]:
    """Local [lo, hi) span of keys that query rows at global positions q0..q1 may see."""
    lo, hi = spec.k_start, spec.k_start + sk
    if spec.causal:
        hi = min(hi, q1 + 1)
    if spec.doc_bounds is not None:
        bounds = spec.doc_bounds
        lo = max(lo, bounds[bisect.bisect_right(bounds, q0) - 1])
        hi = min(hi, bounds[min(bisect.bisect_right(bounds, q1), len(bounds) - 1)])
    return lo - spec.k_start, max(lo, hi) - spec.k_start


def _chunks(spec: MaskSpec, q: torch.Tensor, sk: int, max_scores: int):
    """(rows, keys, mask or None) of each chunk of query rows that sees a key; ``keys`` is the
    local span the chunk can see at all."""
    b, sq, hq, _ = q.shape
    step = max(1, min(MAX_ROWS, max_scores // max(1, b * hq * sk)))
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        q0 = spec.q_start + r0
        k0, k1 = _visible_keys(spec, q0, q0 + (r1 - r0) - 1, sk)
        sub = MaskSpec(spec.causal, q0, spec.k_start + k0, spec.doc_bounds)
        rel = classify(sub, r1 - r0, k1 - k0)
        if rel is not Relation.EMPTY:
            mask = None if rel is Relation.FULL else dense_mask(sub, r1 - r0, k1 - k0, q.device)
            yield slice(r0, r1), slice(k0, k1), mask


def _group_rows(x: torch.Tensor, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, R, Hq, D) -> (B, Hkv, G * R, D): a K/V head's query heads as extra rows."""
    b, r, hq, d = x.shape
    g = hq // hkv
    return x.to(dtype).view(b, r, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * r, d)


def _ungroup_rows(x: torch.Tensor, r: int) -> torch.Tensor:
    """(B, Hkv, G * R, D) -> (B, R, Hq, D)."""
    b, hkv, gr, d = x.shape
    g = gr // r
    return x.view(b, hkv, g, r, d).permute(0, 3, 1, 2, 4).reshape(b, r, hkv * g, d)


def _scores(qg, kt, scale, mask, g):
    """Masked scores (B, Hkv, G*R, Sk) of grouped queries against transposed keys."""
    s = torch.matmul(qg, kt).mul_(scale)  # (B, Hkv, G*R, Sk)
    if mask is not None:
        b, hkv, gr, sk = s.shape
        s.view(b, hkv, g, gr // g, sk).masked_fill_(~mask, float("-inf"))
    return s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(S - lse) in place, with rows whose lse is -inf giving 0 (not NaN)."""
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return s.sub_(lse_safe.unsqueeze(-1)).exp_()


def reference_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
                      scale: float, *, max_scores: int = MAX_SCORES
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a block, q (B, Sq, Hq, D) against k, v (B, Sk, Hkv, D) under ``spec``,
    holding at most ``max_scores`` score elements at once."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, ct = hq // hkv, lse_dtype(q.dtype)
    kt = k.to(ct).permute(0, 2, 3, 1)  # (B, Hkv, D, Sk)
    vh = v.to(ct).transpose(1, 2)  # (B, Hkv, Sk, D)
    out = torch.zeros(b, sq, hq, d, dtype=q.dtype, device=q.device)  # (B, Sq, Hq, D)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=ct, device=q.device)  # (B, Hq, Sq)
    for rows, keys, mask in _chunks(spec, q, sk, max_scores):
        r = rows.stop - rows.start
        qg = _group_rows(q[:, rows], hkv, ct)  # (B, Hkv, G*R, D)
        s = _scores(qg, kt[..., keys], scale, mask, g)  # (B, Hkv, G*R, K)
        lse_c = torch.logsumexp(s, dim=-1)  # (B, Hkv, G*R); -inf for rows that see nothing
        o = torch.matmul(_probs(s, lse_c), vh[:, :, keys])  # (B, Hkv, G*R, D)
        out[:, rows] = _ungroup_rows(o, r).to(q.dtype)
        lse[:, :, rows] = lse_c.view(b, hkv, g, r).reshape(b, hq, r)
    return out, lse


def reference_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, spec: MaskSpec, scale: float, *,
                       dlse: torch.Tensor | None = None, max_scores: int = MAX_SCORES
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of a block from the FINAL (merged) ``out`` and ``lse`` of its rows and
    the lse's gradient ``dlse`` when a loss uses it, in the inputs' dtype."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, ct = hq // hkv, lse_dtype(q.dtype)
    kh = k.to(ct).transpose(1, 2)  # (B, Hkv, Sk, D)
    vt = v.to(ct).permute(0, 2, 3, 1)  # (B, Hkv, D, Sk)
    dq = torch.zeros(b, sq, hq, d, dtype=q.dtype, device=q.device)  # (B, Sq, Hq, D)
    dk = torch.zeros(b, hkv, sk, d, dtype=ct, device=q.device)  # (B, Hkv, Sk, D)
    dv = torch.zeros(b, hkv, sk, d, dtype=ct, device=q.device)
    for rows, keys, mask in _chunks(spec, q, sk, max_scores):
        r = rows.stop - rows.start
        qg = _group_rows(q[:, rows], hkv, ct)  # (B, Hkv, G*R, D)
        dog = _group_rows(do[:, rows], hkv, ct)  # (B, Hkv, G*R, D)
        delta = (dog * _group_rows(out[:, rows], hkv, ct)).sum(-1, keepdim=True)  # (B,Hkv,G*R,1)
        if dlse is not None:
            delta -= dlse[:, :, rows].to(ct).reshape(b, hkv, g * r, 1)
        lse_c = lse[:, :, rows].to(ct).reshape(b, hkv, g * r)  # (B, Hkv, G*R)
        k_c = kh[:, :, keys]  # (B, Hkv, K, D)
        p = _probs(_scores(qg, k_c.transpose(-1, -2), scale, mask, g), lse_c)  # (B,Hkv,G*R,K)
        dv[:, :, keys] += torch.matmul(p.transpose(-1, -2), dog)  # (B, Hkv, K, D)
        ds = torch.matmul(dog, vt[..., keys]).sub_(delta).mul_(p)  # (B, Hkv, G*R, K)
        dq[:, rows] = _ungroup_rows(torch.matmul(ds, k_c).mul_(scale), r).to(q.dtype)
        dk[:, :, keys] += torch.matmul(ds.transpose(-1, -2), qg).mul_(scale)  # (B, Hkv, K, D)
    return dq, dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype)
