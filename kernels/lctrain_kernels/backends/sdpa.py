"""Backends on torch's own fused attention ops that return the log-sum-exp: cuDNN, and the CPU op.

The aten ops behind ``scaled_dot_product_attention`` return the lse, and their backward ops
accept an output and lse we pass in: the MERGED ones of several blocks. Schemas relied on (torch
2.11 .. 2.13)::

    _scaled_dot_product_cudnn_attention(q, k, v, attn_bias, compute_log_sumexp, dropout_p,
        is_causal, return_debug_mask, *, scale) -> (out, lse, cum_seq_q, cum_seq_k, ...)
    _scaled_dot_product_cudnn_attention_backward(grad_out, q, k, v, out, lse, philox_seed,
        philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        *, scale) -> (dq, dk, dv)
    _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
        scale) -> (out, lse)            and its _backward(grad_out, q, k, v, out, lse, ...)

All take (B, H, S, D) views of contiguous BSHD tensors, so q, out and grad_out share one stride
pattern (cuDNN's backward wants dO laid out like O). cuDNN's lse is (B, H, S, 1) from torch 2.9
on and goes back so, contiguous (older cuDNN assumes packed statistics); max_q/max_k must be the
true lengths. Both ops align a non-square causal mask top-left, as CAUSAL blocks are.
"""
from __future__ import annotations

import torch

from lctrain_kernels.backends import BackendUnavailable, UnitValueLseGrad, half_head_dim_reason
from lctrain_kernels.masks import MaskSpec, Relation

_DENSE = (Relation.FULL, Relation.CAUSAL)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().transpose(1, 2)  # (B, S, H, D) -> (B, H, S, D) view


class CudnnBackend(UnitValueLseGrad):
    """torch's cuDNN attention; FULL/CAUSAL blocks, fp16/bf16, head dims up to 128."""

    name = "cudnn"

    def __init__(self):
        if not torch.cuda.is_available():
            raise BackendUnavailable("the cudnn backend needs a CUDA GPU and none is visible; "
                                     "use backend='reference' (or 'auto') on this machine.")

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        if not q.is_cuda:
            return f"the cudnn backend runs on CUDA only, and the tensors are on {q.device}."
        if relation not in _DENSE:
            return ("the cudnn backend computes only full or causal blocks, not a "
                    f"{relation.value} one (offset diagonal or document mask); use triton or "
                    f"reference.")
        reason = half_head_dim_reason(self.name, q, 128)
        if reason is None and torch.cuda.get_device_capability(q.device) < (8, 0):
            reason = "the cudnn backend needs an Ampere or newer GPU (compute capability >= 8.0)."
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
        stats = lse.float().contiguous().unsqueeze(-1)  # (B, Hq, Sq, 1), as torch ≥ 2.9 wants
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # never read without dropout
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(do.to(q.dtype)), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out.to(q.dtype)), stats,
            no_rng, no_rng.clone(), None, None, None, q.shape[1], k.shape[1], 0.0,
            relation is Relation.CAUSAL, scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class CpuFlashBackend(UnitValueLseGrad):
    """torch's CPU flash-attention op; FULL/CAUSAL blocks on a CPU, any float dtype."""

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
