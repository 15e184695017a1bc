"""Local attention backends, the rule that picks one, and the entry points of one block.

A backend computes one block (:mod:`lctrain_kernels.masks`) and its backward (:class:`Backend`):

    reference        plain torch in float32, any mask, any device (the oracle; CPU path)
    cpu_flash        torch's CPU flash op; FULL/CAUSAL blocks
    cudnn            torch's cuDNN SDPA op; CUDA, fp16/bf16, FULL/CAUSAL blocks
    triton           lctrain's Triton kernels; every relation, documents skip tiles
    cudnn_ragged     cuDNN's ragged attention (nvidia-cudnn-frontend); every relation, Hopper+
    flash_attn_cute  FlashAttention 4 (flash-attn-4), when installed; every relation, Hopper+

"auto" takes the first backend of :func:`auto_order` that loads and accepts the block, fastest
first. A backend named explicitly is never swapped (:class:`BackendUnavailable` says why it cannot
run a block). EMPTY blocks are skipped before any backend is chosen.

q ``(B, Sq, Hq, D)``, k and v ``(B, Sk, Hkv, D)``; lse ``(B, Hq, Sq)`` float32 (float64 for
float64 inputs), natural log; a row that sees no key gets out = 0 and lse = -inf. The backward
takes the FINAL (merged) out and lse of the block's rows and, when a loss uses the lse, ``dlse``,
which only moves ``delta``. Kernels without a ``dlse`` input get it from one more ordinary backward
(:class:`UnitValueLseGrad`): with ``dO_i = dlse_i e_0``, ``V_j = e_0`` and ``O = 0``,
``dP_ij = dlse_i`` and ``delta = 0``, so its ``dS`` is ``P * dlse``."""
from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import torch

from lctrain_kernels.masks import MaskSpec, Relation, classify
from lctrain_kernels.vocabulary import BACKENDS

__all__ = ["Backend", "BackendUnavailable", "auto_order", "available_backends",
           "block_backward", "block_forward", "check_backend_name", "get_backend",
           "select_backend"]


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


def check_backend_name(name: str) -> str:
    """``name`` if it is "auto" or a known backend, else BackendUnavailable."""
    if name != "auto" and name not in BACKENDS:
        raise BackendUnavailable(f"unknown attention backend {name!r}; choose one of auto, "
                                 f"{', '.join(BACKENDS)}.")
    return name


def get_backend(name: str) -> Backend:
    """The backend called ``name``, or BackendUnavailable saying why it cannot load here."""
    if check_backend_name(name) == "auto":
        raise BackendUnavailable("'auto' is a rule, not a backend; ask select_backend for the "
                                 "backend it picks for a block.")
    module_name, class_name = BACKENDS[name].split(".")
    try:
        module = importlib.import_module(f"lctrain_kernels.backends.{module_name}")
        return getattr(module, class_name)()
    except BackendUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - any import/constructor failure means "not here"
        raise BackendUnavailable(f"the {name} attention backend failed to load "
                                 f"({type(exc).__name__}: {exc}); pick another backend or fix "
                                 f"that installation.") from exc


def available_backends() -> list[str]:
    """Names of the backends that load here (each may still refuse some blocks)."""
    names = []
    for name in BACKENDS:
        try:
            get_backend(name)
        except BackendUnavailable:
            continue
        names.append(name)
    return names


def auto_order(device_type: str, dtype: torch.dtype, relation: Relation) -> tuple[str, ...]:
    """The backends "auto" tries for a (non-EMPTY) block, best first."""
    dense = relation in (Relation.FULL, Relation.CAUSAL)
    if device_type != "cuda":
        return ("cpu_flash", "reference") if dense and device_type == "cpu" else ("reference",)
    if dense and dtype in (torch.float16, torch.bfloat16):
        return ("flash_attn_cute", "cudnn", "triton", "reference")
    return ("flash_attn_cute", "cudnn_ragged", "triton", "reference")


def select_backend(name, q, k, v, spec: MaskSpec, relation: Relation) -> Backend:
    """The backend ``name`` ("auto", a name, or a Backend object) for a block of q against k, v
    under ``spec`` (``relation`` never EMPTY), or BackendUnavailable saying why none."""
    if not isinstance(name, str):
        backend, name = name, getattr(name, "name", type(name).__name__)
    elif name != "auto":
        backend = get_backend(name)
    else:
        reasons = []
        for candidate in auto_order(q.device.type, q.dtype, relation):
            try:
                backend = get_backend(candidate)
            except BackendUnavailable as exc:
                reasons.append(str(exc))
                continue
            reason = backend.unsupported(q, k, v, spec, relation)
            if reason is None:
                return backend
            reasons.append(reason)
        raise BackendUnavailable(f"no attention backend can run this {relation.value} block "
                                 f"({q.dtype}, {q.device.type}): {' '.join(reasons)}")
    reason = backend.unsupported(q, k, v, spec, relation)
    if reason is not None:
        raise BackendUnavailable(f"the {name} backend cannot run this {relation.value} "
                                 f"attention block: {reason}")
    return backend


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec, *,
                  scale: float, backend="auto") -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out (B, Sq, Hq, D), lse (B, Hq, Sq))`` of q (B, Sq, Hq, D) against k, v
    (B, Sk, Hkv, D) at the global positions of ``spec``; None if nothing is visible."""
    relation = classify(spec, q.shape[1], k.shape[1])
    if relation is Relation.EMPTY:
        return None
    return select_backend(backend, q, k, v, spec, relation).forward(q, k, v, spec, relation, scale)


def block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, spec: MaskSpec, *, scale: float,
                   backend="auto", dlse: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Gradients ``(dq, dk, dv)`` of one block from the FINAL (merged) out and lse of its rows
    and the lse's gradient ``dlse`` when a loss uses it; None if the block is EMPTY."""
    relation = classify(spec, q.shape[1], k.shape[1])
    if relation is Relation.EMPTY:
        return None
    chosen = select_backend(backend, q, k, v, spec, relation)
    return chosen.backward(do, q, k, v, out, lse, spec, relation, scale, dlse=dlse)
