"""Local attention backends, the rule that picks one, and the entry points of one block.

A backend computes one block (:mod:`lctrain_kernels.masks`) and its backward, following
:class:`~lctrain_kernels.backends.base.Backend`. By name (``vocabulary.BACKENDS``):

    reference        plain torch in float32, any mask, any device (the oracle; CPU path)
    cpu_flash        torch's CPU flash op; FULL/CAUSAL blocks
    cudnn            torch's cuDNN SDPA op; CUDA, fp16/bf16, FULL/CAUSAL blocks
    triton           lctrain's Triton kernels; every relation, documents skip tiles
    cudnn_ragged     cuDNN's ragged attention through nvidia-cudnn-frontend; every relation,
                     each document's piece one batch entry read in place (Hopper or newer)
    flash_attn_cute  FlashAttention 4 (flash-attn-4), when installed: the same pieces as varlen
                     entries (Hopper or newer)

"auto" takes the first of an order that loads and accepts the block, fastest first as measured
on H100/H200 (``lctrain bench kernel``): on CUDA, FULL/CAUSAL fp16/bf16 blocks go to
flash_attn_cute > cudnn > triton > reference, masked ones (documents, offset diagonals) and
float32 ones to flash_attn_cute > cudnn_ragged > triton > reference; on a CPU cpu_flash >
reference for FULL/CAUSAL blocks, reference otherwise. A backend named explicitly is never
swapped: if it cannot run the block, :class:`BackendUnavailable` says why.

:func:`block_forward` and :func:`block_backward` classify a block, skip it when EMPTY (before
any backend is chosen, so callers also skip what would have fed it) and run the backend; the
backward takes the row's FINAL (merged) output and lse, so the blocks' gradients add up.
"""
from __future__ import annotations

import importlib

import torch

from lctrain_kernels.backends.base import Backend, BackendUnavailable
from lctrain_kernels.masks import MaskSpec, Relation, classify
from lctrain_kernels.vocabulary import BACKENDS

__all__ = ["Backend", "BackendUnavailable", "auto_order", "available_backends", "backend_names",
           "block_backward", "block_forward", "check_backend_name", "get_backend",
           "select_backend"]

_DENSE_CUDA_ORDER = ("flash_attn_cute", "cudnn", "triton", "reference")
_MASKED_CUDA_ORDER = ("flash_attn_cute", "cudnn_ragged", "triton", "reference")
_DENSE_CPU_ORDER = ("cpu_flash", "reference")


def backend_names() -> list[str]:
    """Every backend name, installed or not."""
    return list(BACKENDS)


def check_backend_name(name: str) -> str:
    """Return ``name`` if it is "auto" or a known backend.

    Raises:
        BackendUnavailable: an unknown name.
    """
    if name != "auto" and name not in BACKENDS:
        raise BackendUnavailable(f"unknown attention backend {name!r}; choose one of auto, "
                                 f"{', '.join(BACKENDS)}.")
    return name


def get_backend(name: str) -> Backend:
    """The backend called ``name``, ready to use.

    Raises:
        BackendUnavailable: an unknown name, or a backend that cannot load here (why, and the fix).
    """
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
    """The backends "auto" tries for a (non-EMPTY) block, best first (module docstring)."""
    dense = relation in (Relation.FULL, Relation.CAUSAL)
    if device_type != "cuda":
        return _DENSE_CPU_ORDER if dense and device_type == "cpu" else ("reference",)
    if dense and dtype in (torch.float16, torch.bfloat16):
        return _DENSE_CUDA_ORDER
    return _MASKED_CUDA_ORDER


def select_backend(name, q, k, v, spec: MaskSpec, relation: Relation) -> Backend:
    """The backend that computes a block of q (B, Sq, Hq, D) against k, v (B, Sk, Hkv, D) under
    ``spec`` (``relation`` never EMPTY): ``name`` ("auto", a name, or a Backend object).

    Raises:
        BackendUnavailable: the backend cannot load or run this block, or none can ("auto").
    """
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
    """Attention of one block, q (B, Sq, Hq, D) against k, v (B, Sk, Hkv, D) at the global
    positions of ``spec``, with ``backend`` ("auto", a name, or a Backend object).

    Returns:
        ``(out (B, Sq, Hq, D), lse (B, Hq, Sq) float32)``, or None if nothing is visible.

    Raises:
        BackendUnavailable: the backend cannot run this block.
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
    """Gradients ``(dq, dk, dv)`` of one block from the FINAL (merged) out and lse of its rows
    and the lse's gradient ``dlse`` when a loss uses it; None if the block is EMPTY.

    Raises:
        BackendUnavailable: the backend cannot run this block.
    """
    relation = classify(spec, q.shape[1], k.shape[1])
    if relation is Relation.EMPTY:
        return None
    chosen = select_backend(backend, q, k, v, spec, relation)
    return chosen.backward(do, q, k, v, out, lse, spec, relation, scale, dlse=dlse)
