"""Backends on torch's own fused attention ops that return the log-sum-exp.

``torch.nn.functional.scaled_dot_product_attention`` hides the log-sum-exp, but the aten ops
behind it return it, and their ``_backward`` ops accept an output and lse that we pass in —
so they can compute blocks whose results are merged, and back-propagate from the MERGED
output and lse (see :mod:`lctrain_kernels.combine`). They compute ``delta`` themselves, so a
gradient of the lse takes one more backward (``backends.base.UnitValueLseGrad``). Schemas
relied on (torch 2.11 .. 2.13)::

    _scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p,
        is_causal, return_debug_mask, *, scale)
        -> (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, dbg)
    _scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, out, lse, philox_seed,
        philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        *, scale) -> (dq, dk, dv)
    _scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, return_debug_mask,
        *, scale) -> (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, dbg)
    _scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse, cum_seq_q,
        cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale)
    _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
        scale) -> (out, lse)            and its _backward(grad_out, q, k, v, out, lse, ...)

All take (B, H, S, D) views; we pass ``x.transpose(1, 2)`` of contiguous BSHD tensors, so q,
out and grad_out share one stride pattern (cuDNN's backward wants dO laid out like O) and no
copy is made. Without dropout, the philox seed/offset are never read; cum_seq_* are None
(dense, not nested); max_q/max_k must be the true lengths (cuDNN's backward reads them).
cuDNN returns lse as (B, H, S, 1) from torch 2.9 on and (B, H, S) before, and its backward
expects the same rank back; the lse we pass is made contiguous (cuDNN < 9.26 assumes packed
BHSD statistics).

Limits: these kernels know only "no mask" and "causal", so they compute FULL and CAUSAL blocks,
never PARTIAL. A CAUSAL block may be non-square (``q_start == k_start``, query row i sees key
rows 0..i: top-left). cuDNN and the CPU op align a non-square causal mask top-left, as needed;
torch's flash op is FlashAttention-2, which aligns it bottom-right, so ``flash`` takes square
causal blocks only.
The CUDA ops take fp16/bf16; cuDNN head_dim must be a multiple of 8 up to 128, flash up to
256. Every op takes GQA as is: K/V keep their Hkv heads, query head h reads K/V head
h // (Hq / Hkv), and dK/dV come back with Hkv heads, summed over each group inside the kernel,
so no repeated K/V is ever made. The CPU op takes any float dtype; it is about 2x faster than
the reference on causal blocks, so "auto" uses it on a CPU.
"""
from __future__ import annotations

import torch

from lctrain_kernels.backends.base import BackendUnavailable, UnitValueLseGrad
from lctrain_kernels.masks import MaskSpec, Relation

_HALF = (torch.float16, torch.bfloat16)
_DENSE = (Relation.FULL, Relation.CAUSAL)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


#: torch >= 2.9 returns (and takes back) the cuDNN lse as (B, H, S, 1).
_CUDNN_LSE_UNIT_DIM = _torch_version() >= (2, 9)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().transpose(1, 2)  # (B, S, H, D) -> (B, H, S, D) view


def _no_rng(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Philox seed and offset placeholders (never read without dropout)."""
    return (torch.zeros((), dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.int64, device=device))


def square_causal_reason(name: str, q, k, relation: Relation) -> str | None:
    """Why a backend whose causal mask is aligned bottom-right refuses a non-square causal block."""
    if relation is Relation.CAUSAL and q.shape[1] != k.shape[1]:
        return (f"the {name} backend aligns a causal mask bottom-right, so it computes only "
                f"square causal blocks, not {q.shape[1]} queries by {k.shape[1]} keys.")
    return None


def half_head_dim_reason(name: str, q, max_dim: int) -> str | None:
    """Why a CUDA kernel of fp16/bf16 inputs and head dims a multiple of 8 up to ``max_dim``
    refuses these queries (None: it takes them)."""
    if q.dtype not in _HALF:
        return f"the {name} backend takes float16 or bfloat16, not {q.dtype}."
    d = q.shape[-1]
    if d % 8 or d > max_dim:
        return f"the {name} backend needs head_dim a multiple of 8 up to {max_dim}, not {d}."
    return None


def _cuda_reason(name: str, q, relation: Relation, max_dim: int) -> str | None:
    if not q.is_cuda:
        return f"the {name} backend runs on CUDA only, and the tensors are on {q.device}."
    if relation not in _DENSE:
        return (f"the {name} backend computes only full or causal blocks, not a "
                f"{relation.value} one (offset diagonal or document mask); use triton or "
                f"reference.")
    reason = half_head_dim_reason(name, q, max_dim)
    if reason is not None:
        return reason
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return f"the {name} backend needs an Ampere or newer GPU (compute capability >= 8.0)."
    return None


def _require_cuda(name: str) -> None:
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"the {name} backend needs a CUDA GPU and none is visible; "
                                 f"use backend='reference' (or 'auto') on this machine.")


class CudnnBackend(UnitValueLseGrad):
    """torch's cuDNN attention (fastest measured on H100/H200); FULL/CAUSAL, fp16/bf16."""

    name = "cudnn"

    def __init__(self):
        _require_cuda(self.name)

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        reason = _cuda_reason(self.name, q, relation, 128)
        if reason is None and not torch.backends.cudnn.is_available():
            reason = "the cudnn backend needs torch built with cuDNN."
        return reason

    def forward(self, q, k, v, spec, relation, scale):
        b, sq, hq, _ = q.shape
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, relation is Relation.CAUSAL, False,
            scale=scale)[:2]
        return out.transpose(1, 2), lse.reshape(b, hq, sq)  # (B, Sq, Hq, D), (B, Hq, Sq)

    def grads(self, do, q, k, v, out, lse, spec, relation, scale):
        sq, sk = q.shape[1], k.shape[1]
        stats = lse.float().contiguous()  # (B, Hq, Sq)
        if _CUDNN_LSE_UNIT_DIM:
            stats = stats.unsqueeze(-1)  # (B, Hq, Sq, 1)
        seed, offset = _no_rng(q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(do.to(q.dtype)), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out.to(q.dtype)), stats,
            seed, offset, None, None, None, sq, sk, 0.0, relation is Relation.CAUSAL,
            scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class FlashBackend(UnitValueLseGrad):
    """torch's built-in FlashAttention-2 kernels; FULL/CAUSAL, fp16/bf16."""

    name = "flash"

    def __init__(self):
        _require_cuda(self.name)

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        return (_cuda_reason(self.name, q, relation, 256)
                or square_causal_reason(self.name, q, k, relation))

    def forward(self, q, k, v, spec, relation, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, relation is Relation.CAUSAL, False,
            scale=scale)[:2]
        return out.transpose(1, 2), lse[..., :q.shape[1]]  # (B, Sq, Hq, D), (B, Hq, Sq)

    def grads(self, do, q, k, v, out, lse, spec, relation, scale):
        sq, sk = q.shape[1], k.shape[1]
        seed, offset = _no_rng(q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bhsd(do.to(q.dtype)), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out.to(q.dtype)),
            lse.float().contiguous(), None, None, sq, sk, 0.0, relation is Relation.CAUSAL,
            seed, offset, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class CpuFlashBackend(UnitValueLseGrad):
    """torch's CPU flash-attention op; FULL/CAUSAL blocks on a CPU, any float dtype, GQA."""

    name = "cpu_flash"

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        if q.device.type != "cpu":
            return f"the cpu_flash backend runs on CPU tensors only, not on {q.device}."
        if relation not in _DENSE:
            return (f"the cpu_flash backend computes only full or causal blocks, not a "
                    f"{relation.value} one; use reference.")
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return f"the cpu_flash backend takes floating-point tensors, not {q.dtype}."
        return None

    def forward(self, q, k, v, spec, relation, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, relation is Relation.CAUSAL, scale=scale)
        return out.transpose(1, 2), lse  # (B, Sq, Hq, D), (B, Hq, Sq)

    def grads(self, do, q, k, v, out, lse, spec, relation, scale):
        stats = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(do.to(q.dtype)), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out.to(q.dtype)),
            stats.contiguous(), 0.0, relation is Relation.CAUSAL, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
