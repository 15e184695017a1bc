"""What a local attention backend is: the :class:`Backend` protocol, and its error.

q ``(B, Sq, Hq, D)``, k and v ``(B, Sk, Hkv, D)``; lse ``(B, Hq, Sq)`` float32 (float64 for
float64 inputs), natural log; a row that sees no key gets out = 0 and lse = -inf. The backward
takes the FINAL (merged) out and lse of the block's rows and, when a loss uses the lse, its
gradient ``dlse``, which only moves the flash backward's ``delta`` (``reference``). Kernels that
compute ``delta`` themselves get it from one more ordinary backward (:class:`UnitValueLseGrad`):
with ``dO_i = dlse_i e_0``, ``V_j = e_0`` and ``O = 0``, ``dP_ij = dlse_i`` and ``delta = 0``, so
its ``dS`` is ``P * dlse``.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from lctrain_kernels.masks import MaskSpec, Relation

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class BackendUnavailable(RuntimeError):
    """An attention backend is unknown, not installed, or cannot run the requested block."""


@runtime_checkable
class Backend(Protocol):
    """A local attention backend (module docstring)."""

    name: str

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
                    relation: Relation) -> str | None:
        """None if this backend can run the block, else one sentence saying why not."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
                relation: Relation, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q.dtype, lse); never called with Relation.EMPTY."""

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, spec: MaskSpec, relation: Relation,
                 scale: float, dlse: torch.Tensor | None = None) -> Grads:
        """(dq, dk, dv), dk and dv summed over each GQA group, in the inputs' dtype or float32."""


def _widen(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


class UnitValueLseGrad:
    """Base of the backends whose kernels take no lse gradient (module docstring)."""

    def grads(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation,
              scale: float) -> Grads:
        """(dq, dk, dv) from the output's gradient ``do`` alone."""
        raise NotImplementedError

    def backward(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation, scale: float,
                 dlse: torch.Tensor | None = None) -> Grads:
        """See :meth:`Backend.backward`; with ``dlse``, dq and dk come back in float32."""
        dq, dk, dv = self.grads(do, q, k, v, out, lse, spec, relation, scale)
        if dlse is None:
            return dq, dk, dv
        do_unit = torch.zeros_like(q)  # (B, Sq, Hq, D): dlse in feature 0
        do_unit[..., 0] = dlse.transpose(1, 2).to(q.dtype)
        v_unit = torch.zeros_like(v)  # (B, Sk, Hkv, D): e_0 for every key
        v_unit[..., 0] = 1
        lq, lk, _ = self.grads(do_unit, q, k, v_unit, torch.zeros_like(q), lse, spec, relation,
                               scale)
        return _widen(dq) + lq, _widen(dk) + lk, dv


def half_head_dim_reason(name: str, q, max_dim: int) -> str | None:
    """Why fp16/bf16 kernels of head dims a multiple of 8 up to ``max_dim`` refuse q, or None."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the {name} backend takes float16 or bfloat16, not {q.dtype}."
    d = q.shape[-1]
    if d % 8 or d > max_dim:
        return f"the {name} backend needs head_dim a multiple of 8 up to {max_dim}, not {d}."
    return None
