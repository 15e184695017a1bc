"""The triton backend: lctrain's own Triton flash attention behind the Backend protocol.

It runs every relation of a block — FULL, CAUSAL and PARTIAL (offset diagonals, packed
documents) — with masks in global positions, skipping the key tiles no query can see, so
document-masked blocks cost only their visible work. CUDA tensors of float16 / bfloat16 /
float32 with head dims 16..256; on a CPU only under ``TRITON_INTERPRET=1`` (tests).

Calls go through the ``lctrain_kernels::triton_attn_fwd`` / ``triton_attn_bwd`` custom ops
(``lctrain_kernels.triton.ops``), so ``torch.compile`` sees them as opaque operators.
"""
from __future__ import annotations

import torch

import lctrain_kernels.triton.ops  # noqa: F401 - registers torch.ops.lctrain_kernels.triton_attn_*
from lctrain_kernels.masks import MaskSpec, Relation
from lctrain_kernels.triton.launch import check_inputs


def _mask_args(spec: MaskSpec, relation: Relation) -> tuple[bool, int, int, list[int] | None]:
    """(causal, q_start, k_start, doc_bounds) for the ops; a FULL block needs no mask at all."""
    if relation is Relation.FULL:
        return False, spec.q_start, spec.k_start, None
    bounds = list(spec.doc_bounds) if spec.doc_bounds is not None else None
    return bool(spec.causal), spec.q_start, spec.k_start, bounds


class TritonBackend:
    """Our Triton kernels: every relation, GQA by index, documents with tile skipping."""

    name = "triton"

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        try:
            check_inputs(q, k, v)
        except ValueError as exc:
            return str(exc)
        return None

    def forward(self, q, k, v, spec: MaskSpec, relation: Relation, scale: float):
        return torch.ops.lctrain_kernels.triton_attn_fwd(q, k, v, float(scale),
                                                         *_mask_args(spec, relation))

    def backward(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation, scale: float):
        return torch.ops.lctrain_kernels.triton_attn_bwd(do, q, k, v, out, lse, None,
                                                         float(scale),
                                                         *_mask_args(spec, relation))
