"""The reference backend: :mod:`lctrain_kernels.reference` behind the Backend protocol; every
relation, float dtype and device, in float32 math (float64 for float64 inputs)."""
from __future__ import annotations

import torch

from lctrain_kernels.masks import MaskSpec, Relation
from lctrain_kernels.reference import reference_backward, reference_forward

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ReferenceBackend:
    """Plain torch attention with log-sum-exp; any mask, any device."""

    name = "reference"

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        if q.dtype not in _DTYPES:
            return f"the reference backend takes float16/bfloat16/float32/float64, not {q.dtype}."
        return None

    def forward(self, q, k, v, spec: MaskSpec, relation: Relation, scale: float):
        return reference_forward(q, k, v, spec, scale)

    def backward(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation, scale: float,
                 dlse=None):
        return reference_backward(do, q, k, v, out, lse, spec, scale, dlse=dlse)
