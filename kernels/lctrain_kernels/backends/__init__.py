"""Local attention backends and the rule that picks one.

A backend computes one attention block (see :mod:`lctrain_kernels.masks`) and its backward,
following the :class:`~lctrain_kernels.backends.base.Backend` protocol::

    name: str
    unsupported(q, k, v, spec, relation) -> str | None   # None = can run it, else why not
    forward(q, k, v, spec, relation, scale) -> (out, lse)
    backward(do, q, k, v, out, lse, spec, relation, scale, dlse=None) -> (dq, dk, dv)

Backends by name (``lctrain_kernels.vocabulary.BACKENDS``; each module is imported only when
first asked for):

    reference   plain torch, float32 math, any mask, any device (the oracle; CPU path)
    cudnn       torch's cuDNN SDPA op with log-sum-exp; CUDA, fp16/bf16, FULL/CAUSAL
    flash       torch's built-in FlashAttention-2 op; CUDA, fp16/bf16, FULL/CAUSAL
    flash_attn  the flash-attn package, if installed; CUDA, fp16/bf16, FULL/CAUSAL
    triton      lctrain's own Triton kernels; every relation (document masks skip tiles)
    cpu_flash   torch's CPU flash-attention op; CPU, FULL/CAUSAL (about 2x the reference)
    cudnn_ragged  cuDNN's ragged (THD) attention through nvidia-cudnn-frontend: each
                document's piece of a block is one batch entry, read and written in place;
                CUDA (Hopper or newer), fp16/bf16, every relation (lctrain_kernels.ragged)
    flash_attn_cute  FlashAttention 4 (the flash-attn-4 package), if installed: the same
                in-place pieces as varlen batch entries, dense blocks as one entry per row;
                CUDA (Hopper or newer), fp16/bf16, every relation

The "auto" rule (:func:`select_backend`), first one that is available and supports the block:

* CUDA, FULL or CAUSAL block, fp16/bf16: flash_attn_cute > cudnn > triton > flash >
  flash_attn > reference, fastest first as measured on H100/H200 (``lctrain bench kernel``,
  README "Performance"); flash_attn_cute only where FlashAttention 4 is installed.
* CUDA, PARTIAL block (documents, an offset diagonal): flash_attn_cute > cudnn_ragged >
  triton > reference. Both ragged backends ran every document mix measured faster than
  triton, flash_attn_cute faster than cudnn_ragged on every mix (``lctrain bench kernel
  --documents``, docs/performance.md). cudnn_ragged's plans are built for the batch size and
  longest document rounded up to powers of two, so the first steps of a run build them all
  and later rows reuse them. float32 blocks, a GPU neither ragged backward is tested on, or
  a run with torch.use_deterministic_algorithms on go to triton.
* CPU: cpu_flash > reference for FULL/CAUSAL blocks, reference for PARTIAL ones (the CPU op
  takes a mask only as an additive tensor of the inputs' dtype, and the Triton interpreter is
  correct but orders of magnitude slower).

A backend named explicitly is never swapped for another: if it cannot run the block,
:class:`BackendUnavailable` says why.
"""
from __future__ import annotations

import importlib

import torch

from lctrain_kernels.backends.base import Backend, BackendUnavailable
from lctrain_kernels.masks import MaskSpec, Relation
from lctrain_kernels.vocabulary import BACKENDS

__all__ = ["Backend", "BackendUnavailable", "available_backends", "backend_names",
           "check_backend_name", "get_backend", "select_backend"]

_DENSE_CUDA_ORDER = ("flash_attn_cute", "cudnn", "triton", "flash", "flash_attn", "reference")
_MASKED_CUDA_ORDER = ("flash_attn_cute", "cudnn_ragged", "triton", "reference")
_DENSE_CPU_ORDER = ("cpu_flash", "reference")


def backend_names() -> list[str]:
    """Every backend name lctrain knows, installed or not."""
    return list(BACKENDS)


def check_backend_name(name: str) -> str:
    """Return ``name`` if it is "auto" or a known backend (installed or not).

    Raises:
        BackendUnavailable: an unknown name.
    """
    if name != "auto" and name not in BACKENDS:
        raise BackendUnavailable(f"unknown attention backend {name!r}; choose one of auto, "
                                 f"{', '.join(BACKENDS)}.")
    return name


def get_backend(name: str) -> Backend:
    """The backend called ``name``, ready to use.

    Args:
        name: one of :func:`backend_names`.

    Returns:
        An object following the Backend protocol.

    Raises:
        BackendUnavailable: if the name is unknown, or the backend cannot load on this
            machine (the message says why and how to fix it).
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
    """Names of the backends that load on this machine (each may still refuse some blocks)."""
    names = []
    for name in BACKENDS:
        try:
            get_backend(name)
        except BackendUnavailable:
            continue
        names.append(name)
    return names


def auto_order(device_type: str, dtype: torch.dtype, relation: Relation) -> tuple[str, ...]:
    """The backends "auto" tries, in order, for a block (the rule of the module docstring).

    Args:
        device_type: the tensors' device type ("cuda", "cpu", ...).
        dtype: the inputs' dtype.
        relation: the block's relation (not EMPTY).

    Returns:
        Backend names, best first; the first that loads and supports the block runs it.
    """
    dense = relation in (Relation.FULL, Relation.CAUSAL)
    if device_type != "cuda":
        return _DENSE_CPU_ORDER if dense and device_type == "cpu" else ("reference",)
    half = dtype in (torch.float16, torch.bfloat16)
    if dense and half:
        return _DENSE_CUDA_ORDER
    return _MASKED_CUDA_ORDER


def select_backend(name, q, k, v, spec: MaskSpec, relation: Relation) -> Backend:
    """The backend that will compute this block (the "auto" rule is in the module docstring).

    Args:
        name: "auto", a backend name, or a Backend object.
        q: (B, Sq, Hq, D) queries of the block.
        k: (B, Sk, Hkv, D) keys.
        v: (B, Sk, Hkv, D) values.
        spec: the block's mask.
        relation: ``classify(spec, Sq, Sk)``; never EMPTY here.

    Returns:
        A Backend object that supports the block.

    Raises:
        BackendUnavailable: if the named backend cannot load or cannot run this block, or (for
            "auto") if no backend can.
    """
    if not isinstance(name, str):
        backend, name = name, getattr(name, "name", type(name).__name__)
    elif name != "auto":
        backend = get_backend(name)
    else:
        reasons = []
        order = auto_order(q.device.type, q.dtype, relation)
        for candidate in order:
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
