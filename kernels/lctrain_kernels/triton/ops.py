"""The Triton attention as torch operators: custom ops, fake kernels, autograd, functional API.

Two ``torch.library.custom_op`` s wrap the launchers so that ``torch.compile`` traces them as
opaque calls (``register_fake`` gives the output shapes without running anything):

    torch.ops.lctrain_kernels.triton_attn_fwd(q, k, v, scale, causal, q_start, k_start,
                                              doc_bounds) -> (out, lse)
    torch.ops.lctrain_kernels.triton_attn_bwd(do, q, k, v, out, lse, dlse, scale, causal,
                                              q_start, k_start, doc_bounds) -> (dq, dk, dv)

The forward op is differentiable (``register_autograd``): its backward saves q, k, v, out and
lse — never the attention matrix — and calls the backward op, folding a gradient of lse in.
:func:`triton_attention` is the functional entry point on top.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from lctrain_kernels.triton.launch import flash_backward, flash_forward


@torch.library.custom_op("lctrain_kernels::triton_attn_fwd", mutates_args=())
def triton_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool, q_start: int, k_start: int,
                    doc_bounds: Optional[List[int]]) -> Tuple[torch.Tensor, torch.Tensor]:
    return flash_forward(q, k, v, scale=scale, causal=causal, q_start=q_start, k_start=k_start,
                         doc_bounds=doc_bounds)


@triton_attn_fwd.register_fake
def _fwd_fake(q, k, v, scale, causal, q_start, k_start, doc_bounds):
    B, Sq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Sq), dtype=torch.float32)


@torch.library.custom_op("lctrain_kernels::triton_attn_bwd", mutates_args=())
def triton_attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                    scale: float, causal: bool, q_start: int, k_start: int,
                    doc_bounds: Optional[List[int]]
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_backward(do, q, k, v, out, lse, scale=scale, causal=causal, q_start=q_start,
                          k_start=k_start, doc_bounds=doc_bounds, dlse=dlse)


@triton_attn_bwd.register_fake
def _bwd_fake(do, q, k, v, out, lse, dlse, scale, causal, q_start, k_start, doc_bounds):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, q_start, k_start, doc_bounds = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.mask = (scale, causal, q_start, k_start, doc_bounds)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.lctrain_kernels.triton_attn_bwd(dout, q, k, v, out, lse, dlse,
                                                           *ctx.mask)
    return dq, dk, dv, None, None, None, None, None


triton_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                     softmax_scale: float | None = None, q_start: int = 0, k_start: int = 0,
                     doc_bounds=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention of one block with our Triton kernels.

    Args:
        q: (B, Sq, Hq, D) queries; k, v: (B, Sk, Hkv, D) keys and values, ``Hq % Hkv == 0``
            (GQA by index, K/V never repeated). CUDA tensors (or CPU under TRITON_INTERPRET=1).
        causal: key global position must not exceed the query's.
        softmax_scale: default ``D ** -0.5``.
        q_start, k_start: global positions of the first query and key row.
        doc_bounds: global ``cu_seqlens`` (host ints) of packed documents, or None.

    Returns:
        ``(out, lse)``: out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) float32 natural log;
        both carry gradients back to q, k and v.

    Raises:
        ValueError: on shapes, dtypes or devices the kernels cannot take.
    """
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    bounds = [int(x) for x in doc_bounds] if doc_bounds is not None else None
    return torch.ops.lctrain_kernels.triton_attn_fwd(q, k, v, scale, bool(causal), int(q_start),
                                                     int(k_start), bounds)
