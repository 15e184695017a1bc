"""Plain-torch attention with log-sum-exp for any mask: the oracle, and the CPU path.

For one block (queries ``q``, keys ``k``, values ``v``; see :mod:`lctrain_kernels.masks`)::

    S   = scale * q k^T              scores, -inf where the mask hides a pair
    lse = logsumexp_j S              per query row (natural log); -inf if the row sees nothing
    P   = exp(S - lse)               probabilities (0 on hidden pairs and on empty rows)
    out = P v

The backward takes the FINAL output ``O`` and log-sum-exp of the query rows — after any merge
with other blocks — and recomputes the probabilities, as FlashAttention does::

    P     = exp(S - lse)             this block's share of the final softmax
    dV    = P^T dO
    dP    = dO V^T
    delta = rowsum(dO * O) - dlse    the same for every block of a row (dlse: the gradient
                                     of the lse, when a loss uses it; d lse_i / d S_ij = P_ij)
    dS    = P * (dP - delta)
    dQ    = scale * dS K,  dK = scale * dS^T Q

Because ``lse`` and ``O`` are the merged ones, the gradients of the blocks of a row simply add
up to the gradient of the whole attention (the distributed backward relies on this).

Grouped-query attention without copying K/V: the ``G = Hq / Hkv`` query heads that share one
K/V head are laid side by side as extra rows, ``(B, Hkv, G * rows, D)``, so one batched matmul
against ``(B, Hkv, D, Sk)`` serves the whole group, and ``dS^T Q`` sums the group's dK for free.

The math runs in float32 (float64 stays float64); query rows are processed in chunks so that
the score matrix held at once stays bounded (``max_scores`` elements), and a chunk that the
mask hides entirely is skipped, one that it shows entirely needs no mask.
"""
from __future__ import annotations

import bisect

import torch

from lctrain_kernels.masks import MaskSpec, Relation, classify, dense_mask

#: default bound on the score elements (B * Hq * rows * Sk) held at once: 64 MiB in float32.
MAX_SCORES = 1 << 24
#: at most this many query rows per chunk, so causal/document chunks skip hidden keys.
MAX_ROWS = 256


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    """Yield (rows, keys, relation, mask or None) for each chunk of query rows.

    ``rows`` and ``keys`` are local slices; keys outside the span the chunk can see (above the
    causal diagonal, outside its documents) are cut off before any matmul.
    """
    b, sq, hq, _ = q.shape
    step = max(1, min(MAX_ROWS, max_scores // max(1, b * hq * sk)))
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        q0 = spec.q_start + r0
        k0, k1 = _visible_keys(spec, q0, q0 + (r1 - r0) - 1, sk)
        sub = MaskSpec(spec.causal, q0, spec.k_start + k0, spec.doc_bounds)
        rel = classify(sub, r1 - r0, k1 - k0)
        mask = None
        if rel not in (Relation.EMPTY, Relation.FULL):
            mask = dense_mask(sub, r1 - r0, k1 - k0, q.device)
        yield slice(r0, r1), slice(k0, k1), rel, mask


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
    """Attention of one block with its log-sum-exp, in float32 (float64 for float64 inputs).

    Args:
        q: (B, Sq, Hq, D) queries.
        k: (B, Sk, Hkv, D) keys, ``Hq % Hkv == 0``.
        v: (B, Sk, Hkv, D) values.
        spec: the block's mask in global positions.
        scale: softmax scale applied to ``q k^T``.
        max_scores: bound on the score elements held at once (rows are chunked to fit).

    Returns:
        ``(out, lse)``: (B, Sq, Hq, D) in ``q.dtype`` (0 for rows that see no key) and
        (B, Hq, Sq) float32 (float64 for float64 inputs), natural log, -inf for such rows.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, ct = hq // hkv, _compute_dtype(q.dtype)
    kt = k.to(ct).permute(0, 2, 3, 1)  # (B, Hkv, D, Sk)
    vh = v.to(ct).transpose(1, 2)  # (B, Hkv, Sk, D)
    out = torch.zeros(b, sq, hq, d, dtype=q.dtype, device=q.device)  # (B, Sq, Hq, D)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=ct, device=q.device)  # (B, Hq, Sq)
    for rows, keys, rel, mask in _chunks(spec, q, sk, max_scores):
        if rel is Relation.EMPTY:
            continue
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
    """Gradients of one block from the FINAL (merged) output and log-sum-exp of its rows.

    Args:
        do: (B, Sq, Hq, D) gradient of the final output.
        q: (B, Sq, Hq, D) queries.
        k: (B, Sk, Hkv, D) keys.
        v: (B, Sk, Hkv, D) values.
        out: (B, Sq, Hq, D) final output of these query rows (after merging all blocks).
        lse: (B, Hq, Sq) final log-sum-exp of these rows.
        spec: the block's mask in global positions.
        scale: the softmax scale of the forward.
        dlse: (B, Hq, Sq) gradient of the final lse, or None when no loss uses it.
        max_scores: bound on the score elements held at once.

    Returns:
        ``(dq, dk, dv)``: (B, Sq, Hq, D) and (B, Sk, Hkv, D) twice (summed over each GQA
        group), in the inputs' dtype.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, ct = hq // hkv, _compute_dtype(q.dtype)
    kh = k.to(ct).transpose(1, 2)  # (B, Hkv, Sk, D)
    vt = v.to(ct).permute(0, 2, 3, 1)  # (B, Hkv, D, Sk)
    dq = torch.zeros(b, sq, hq, d, dtype=q.dtype, device=q.device)  # (B, Sq, Hq, D)
    dk = torch.zeros(b, hkv, sk, d, dtype=ct, device=q.device)  # (B, Hkv, Sk, D)
    dv = torch.zeros(b, hkv, sk, d, dtype=ct, device=q.device)
    for rows, keys, rel, mask in _chunks(spec, q, sk, max_scores):
        if rel is Relation.EMPTY:
            continue
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
