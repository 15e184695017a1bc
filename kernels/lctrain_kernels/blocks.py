"""Block entry points: classify a block, skip it if empty, otherwise run the chosen backend.

These two functions are what the attention executor calls
(:mod:`lctrain_kernels.distributed.executor`: one call per (query chunk, key chunk) piece of
its schedule; local attention is a schedule of one block). An EMPTY block returns None before
any backend is chosen or any kernel launched, so callers can also skip the communication that
would have fed it. Partial results of the blocks of one query row are combined with
:mod:`lctrain_kernels.combine`; the backward of each block then takes the row's FINAL (merged)
output and log-sum-exp (and that lse's gradient, when a loss uses it), and the blocks'
gradients add up.
"""
from __future__ import annotations

import torch

from lctrain_kernels.backends import select_backend
from lctrain_kernels.masks import MaskSpec, Relation, classify


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec, *,
                  scale: float, backend="auto") -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of one block with its log-sum-exp.

    Args:
        q: (B, Sq, Hq, D) queries at global positions ``spec.q_start ...``.
        k: (B, Sk, Hkv, D) keys at global positions ``spec.k_start ...``.
        v: (B, Sk, Hkv, D) values.
        spec: the block's mask in global positions.
        scale: softmax scale.
        backend: "auto", a backend name, or a Backend object.

    Returns:
        ``(out, lse)`` — (B, Sq, Hq, D) in ``q.dtype`` and (B, Hq, Sq) float32 — or None if
        no pair of the block is visible.

    Raises:
        BackendUnavailable: if the backend cannot run this block.
    """
    relation = classify(spec, q.shape[1], k.shape[1])
    if relation is Relation.EMPTY:
        return None
    chosen = select_backend(backend, q, k, v, spec, relation)
    return chosen.forward(q, k, v, spec, relation, scale)


def block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, spec: MaskSpec, *, scale: float,
                   backend="auto", dlse: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Gradients of one block, from the FINAL (merged) output and lse of its query rows.

    Args:
        do: (B, Sq, Hq, D) gradient of the final output.
        q: (B, Sq, Hq, D) queries.
        k: (B, Sk, Hkv, D) keys.
        v: (B, Sk, Hkv, D) values.
        out: (B, Sq, Hq, D) final output of these rows (after merging every block).
        lse: (B, Hq, Sq) float32 final log-sum-exp of these rows.
        spec: the block's mask in global positions.
        scale: the forward's softmax scale.
        backend: "auto", a backend name, or a Backend object.
        dlse: (B, Hq, Sq) gradient of the final lse, or None when no loss uses it.

    Returns:
        ``(dq, dk, dv)`` — (B, Sq, Hq, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), summed over each
        GQA group, in the inputs' dtype or float32 — or None if the block is empty.

    Raises:
        BackendUnavailable: if the backend cannot run this block.
    """
    relation = classify(spec, q.shape[1], k.shape[1])
    if relation is Relation.EMPTY:
        return None
    chosen = select_backend(backend, q, k, v, spec, relation)
    return chosen.backward(do, q, k, v, out, lse, spec, relation, scale, dlse=dlse)
