"""Launcher of the experimental single-pass backward (``backward_tma.py``).

Same layout, mask arguments and results as :func:`lctrain_kernels.triton.launch.flash_backward`
(whose checks and helpers it reuses); the difference is the algorithm: one kernel over the key
tiles that also reduce-adds dQ into a zeroed float32 buffer with the TMA, then a small kernel
that scales and casts dQ. It is not autotuned: one fixed tile configuration per call
(``config``, default :data:`DEFAULT_CONFIG`), since the TMA descriptor's block shape depends
on BLOCK_M and ``scripts/gpu_bwd_tma.py`` sweeps the configurations by hand.

Needs a GPU with TMA (compute capability 9.0 or newer, Hopper) and float16 / bfloat16 inputs.
Under ``TRITON_INTERPRET=1`` any dtype runs, with an element-wise atomic add in place of the
TMA reduce (the interpreter has none).
"""
from __future__ import annotations

import torch
import triton

from lctrain_kernels.triton.backward_tma import attn_bwd_dq_convert_kernel, attn_bwd_fused_kernel
from lctrain_kernels.triton.common import interpreting
from lctrain_kernels.triton.configs import INTERPRET_CONFIGS
from lctrain_kernels.triton.launch import (_buffer, _delta, _flags, _head_dim_contiguous,
                                           _mask_arrays, _strides3, check_inputs, mask_plan)

#: Tiles when no ``config`` is given: the fastest of scripts/gpu_bwd_tma.py on an H200 with
#: Triton 3.6 (340 TFLOP/s at 16K; 64 x 128 tiles spill ~60 registers per thread: 318).
DEFAULT_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
TMA_DTYPES = (torch.float16, torch.bfloat16)
CONVERT_BLOCK = 64
INT32_MAX = 2**31 - 1


def check_tma(q: torch.Tensor) -> None:
    """Raise ValueError unless ``q`` can take the TMA path (or the interpreter runs it)."""
    if interpreting():
        return
    if q.dtype not in TMA_DTYPES:
        raise ValueError(f"flash_backward_tma takes float16 or bfloat16 inputs, got {q.dtype}; "
                         f"use flash_backward for {q.dtype}.")
    major, minor = torch.cuda.get_device_capability(q.device)
    if major < 9:
        raise ValueError(f"flash_backward_tma needs TMA (compute capability >= 9.0), "
                         f"{torch.cuda.get_device_name(q.device)} has {major}.{minor}; "
                         f"use flash_backward.")


def _dq_accumulator(heads: int, d_pad: int, sq_pad: int, block_m: int, device):
    """The zeroed transposed dQ accumulator (heads * d_pad, sq_pad) float32, and what the kernel
    takes for it: a TMA descriptor with (d_pad, block_m) boxes, or the tensor itself (pointer)
    under the interpreter."""
    dq_acc = torch.zeros(heads * d_pad, sq_pad, dtype=torch.float32, device=device)
    if interpreting():
        return dq_acc, dq_acc
    from triton.tools.tensor_descriptor import TensorDescriptor
    return dq_acc, TensorDescriptor(dq_acc, list(dq_acc.shape), [sq_pad, 1], [d_pad, block_m])


def flash_backward_tma(do, q, k, v, out, lse, *, scale: float | None = None,
                       causal: bool = False, q_start: int = 0, k_start: int = 0,
                       doc_bounds=None, dlse=None, dq=None, dk=None, dv=None,
                       config: dict | None = None):
    """Gradients of one block in a single pass over key tiles, dQ by TMA reduce-add.

    Args:
        do: (B, Sq, Hq, D) gradient of ``out``. q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D).
        out: (B, Sq, Hq, D) final output; lse: (B, Hq, Sq) final natural log-sum-exp.
        scale, causal, q_start, k_start, doc_bounds: as in ``flash_forward``.
        dlse: optional (B, Hq, Sq) gradient of ``lse``.
        dq, dk, dv: optional output buffers (any float dtype).
        config: fixed tiles ``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}`` of the fused
            kernel (BLOCK_M over queries, BLOCK_N over keys); default :data:`DEFAULT_CONFIG`
            (the interpreter's dK/dV tiles under ``TRITON_INTERPRET=1``).

    Returns:
        ``(dq, dk, dv)``: dq (B, Sq, Hq, D), dk and dv (B, Sk, Hkv, D) summed over each GQA
        group, in the inputs' dtype unless buffers were given.

    Raises:
        ValueError: on inputs the kernels cannot take, a GPU without TMA, or a float32 input.
    """
    B, Sq, Hq, D, Sk, Hkv = check_inputs(q, k, v)
    if do.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != (B, Hq, Sq):
        raise ValueError(f"do and out must be {tuple(q.shape)} and lse {(B, Hq, Sq)}, got "
                         f"{tuple(do.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}.")
    check_tma(q)
    if config is None:
        config = INTERPRET_CONFIGS["dkdv"] if interpreting() else DEFAULT_CONFIG
    block_m, d_pad = config["BLOCK_M"], max(16, triton.next_power_of_2(D))
    sq_pad = triton.cdiv(Sq, block_m) * block_m
    if B * Hq * d_pad > INT32_MAX:
        raise ValueError(f"batch x heads x head dim = {B * Hq * d_pad} exceeds the TMA "
                         f"coordinate limit {INT32_MAX}; split the batch.")
    scale = D ** -0.5 if scale is None else float(scale)
    plan = mask_plan(Sq, Sk, causal, q_start, k_start, doc_bounds)
    q, k, v, do, out = (_head_dim_contiguous(x) for x in (q, k, v, do, out))
    lse = lse.to(torch.float32).contiguous()
    delta = _delta(out, do, lse.shape, dlse)  # (B, Hq, Sq)
    dq = _buffer(dq, q.shape, q.dtype, q, "dq")  # (B, Sq, Hq, D)
    dk = _buffer(dk, k.shape, k.dtype, q, "dk")  # (B, Sk, Hkv, D)
    dv = _buffer(dv, v.shape, v.dtype, q, "dv")  # (B, Sk, Hkv, D)
    dq_acc, dq_arg = _dq_accumulator(B * Hq, d_pad, sq_pad, block_m, q.device)
    q_lo, q_hi = _mask_arrays(plan, Sq, Sk, q_start, k_start, causal, q.device, lse, True)
    grid = (triton.cdiv(Sk, config["BLOCK_N"]), B * Hkv)
    attn_bwd_fused_kernel[grid](
        Q=q, K=k, V=v, DO=do, DK=dk, DV=dv, DQ_ACC=dq_arg, Lse=lse, Delta=delta, Q_LO=q_lo,
        Q_HI=q_hi, sm_scale=scale, causal_off=plan[1],
        **dict(zip(("stride_qb", "stride_qs", "stride_qh"), _strides3(q))),
        **dict(zip(("stride_kb", "stride_ks", "stride_kh"), _strides3(k))),
        **dict(zip(("stride_vb", "stride_vs", "stride_vh"), _strides3(v))),
        **dict(zip(("stride_db", "stride_ds", "stride_dh"), _strides3(do))),
        **dict(zip(("stride_dkb", "stride_dks", "stride_dkh"), _strides3(dk))),
        **dict(zip(("stride_dvb", "stride_dvs", "stride_dvh"), _strides3(dv))),
        Hq=Hq, Hkv=Hkv, GROUP=Hq // Hkv, Sq=Sq, Sk=Sk, SQ_PAD=sq_pad,
        HEAD_DIM=D, HEAD_DIM_PAD=d_pad, MASK_MODE=plan[0], TMA_REDUCE=not interpreting(),
        **_flags(q.dtype), **config)
    attn_bwd_dq_convert_kernel[(triton.cdiv(Sq, CONVERT_BLOCK), B * Hq)](
        dq_acc, dq, scale, *_strides3(dq), Hq, Sq, sq_pad, HEAD_DIM=D, HEAD_DIM_PAD=d_pad,
        BLOCK_M=CONVERT_BLOCK)
    return dq, dk, dv
