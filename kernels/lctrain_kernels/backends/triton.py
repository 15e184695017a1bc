"""The triton backend: lctrain's Triton flash attention (:mod:`lctrain_kernels.triton`) behind the
Backend protocol; the lse's gradient folds into the kernels' delta at no extra cost."""
from __future__ import annotations

from lctrain_kernels.masks import MaskSpec, Relation
from lctrain_kernels.triton.launch import check_inputs, flash_backward, flash_forward


def _mask_args(spec: MaskSpec, relation: Relation) -> dict:
    """The launchers' mask arguments; a FULL block needs no mask at all."""
    full = relation is Relation.FULL
    return dict(causal=bool(spec.causal) and not full, q_start=spec.q_start,
                k_start=spec.k_start, doc_bounds=None if full else spec.doc_bounds)


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
        return flash_forward(q, k, v, scale=float(scale), **_mask_args(spec, relation))

    def backward(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation, scale: float,
                 dlse=None):
        return flash_backward(do, q, k, v, out, lse, scale=float(scale), dlse=dlse,
                              **_mask_args(spec, relation))
