"""What a local attention backend is: the :class:`Backend` protocol, and its error.

A backend computes one attention *block* — queries against keys, both at given global positions
(a :class:`~lctrain_kernels.masks.MaskSpec`) — and that block's backward. Layout everywhere:
q ``(B, Sq, Hq, D)``, k and v ``(B, Sk, Hkv, D)`` with ``Hq % Hkv == 0``; lse ``(B, Hq, Sq)``
float32 (float64 for float64 inputs), natural log. A query row that sees no key gets out = 0
and lse = -inf.

The backward takes the FINAL (merged) out and lse of the block's query rows, and the gradient
of that lse when a loss uses it. ``lse_i = log sum_j exp(s_ij)`` gives ``d lse_i / d s_ij =
P_ij``, so a gradient ``dlse`` only moves the ``delta`` of the flash backward::

    dS = P * (dP - delta)      with   delta = rowsum(dO * O) - dlse

Kernels whose backward computes ``delta`` themselves (torch's SDPA ops, flash-attn) cannot take
that; :class:`UnitValueLseGrad` gives them the same gradient from one more ordinary backward,
run only when ``dlse`` is given: with ``dO_i = dlse_i e_0``, ``V_j = e_0`` and ``O = 0``,
``dP_ij = dlse_i`` and ``delta = 0``, so its ``dS`` is exactly ``P * dlse``.
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
    """A local attention backend (see the module docstring for layouts and the lse gradient)."""

    name: str
    """The name it is registered under (``lctrain_kernels.vocabulary.BACKENDS``)."""

    def unsupported(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
                    relation: Relation) -> str | None:
        """None if this backend can run the block, else one sentence saying why not."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec,
                relation: Relation, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q.dtype, lse). Never called with Relation.EMPTY."""

    def backward(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, spec: MaskSpec, relation: Relation,
                 scale: float, dlse: torch.Tensor | None = None) -> Grads:
        """dq (B, Sq, Hq, D), dk and dv (B, Sk, Hkv, D) summed over each GQA group, in the
        inputs' dtype or float32. ``out``, ``lse`` are the final ones of these query rows;
        ``dlse`` (B, Hq, Sq), when given, is the gradient of that lse."""


def _widen(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


class UnitValueLseGrad:
    """Base of the backends whose kernels take no lse gradient: ``backward`` runs
    :meth:`grads` and, when ``dlse`` is given, one more with unit values (module docstring)."""

    def grads(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation,
              scale: float) -> Grads:
        """(dq, dk, dv) from the output's gradient ``do`` alone."""
        raise NotImplementedError

    def backward(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation, scale: float,
                 dlse: torch.Tensor | None = None) -> Grads:
        """See :meth:`Backend.backward`; with ``dlse``, dq and dk come back in float32 (or
        float64) since they are sums of two backwards."""
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
