"""Launchers of the Triton attention kernels: checks, mask plan, buffers, grid, autotuning.

Inputs take any strides with a contiguous head dim. The mask is given in GLOBAL positions as in
:class:`~lctrain_kernels.masks.MaskSpec`; :func:`mask_plan` turns it into a kernel mode, dropping
what cannot matter for the block. Autotuned on a GPU (``configs``); one fixed tile under the
interpreter or with an explicit ``config``."""
from __future__ import annotations

import bisect

import torch
import triton
from triton.runtime.errors import OutOfResources

from lctrain_kernels.triton.backward import (attn_bwd_delta_kernel, attn_bwd_dkdv_kernel,
                                             attn_bwd_dq_kernel)
from lctrain_kernels.triton.common import (MASK_CAUSAL, MASK_NONE, MASK_RANGES, interpreting,
                                           interval_arrays, last_dim_contiguous)
from lctrain_kernels.triton.configs import (DKDV_POINTS, DQ_POINTS, FP32_POINTS, FWD_POINTS,
                                            INTERPRET_CONFIGS, SAFE_CONFIG, autotuned, seq_bucket)
from lctrain_kernels.triton.forward import attn_fwd_kernel


DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
MAX_GRID_Y = 65535

fwd_tuned = autotuned(attn_fwd_kernel, "fwd", FWD_POINTS)
dkdv_tuned = autotuned(attn_bwd_dkdv_kernel, "dkdv", DKDV_POINTS)
dq_tuned = autotuned(attn_bwd_dq_kernel, "dq", DQ_POINTS)
FP32_TUNED = {kind: autotuned(kernel, kind, FP32_POINTS[kind]) for kind, kernel in
              (("fwd", attn_fwd_kernel), ("dkdv", attn_bwd_dkdv_kernel),
               ("dq", attn_bwd_dq_kernel))}


def check_inputs(q, k, v) -> tuple[int, int, int, int, int, int]:
    """(B, Sq, Hq, D, Sk, Hkv) of q, k, v, or ValueError saying why the kernels cannot take them."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"triton attention takes 4-D (batch, seq, heads, head_dim) tensors, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    B, Sq, Hq, D = q.shape
    Bk, Sk, Hkv, Dk = k.shape
    if k.shape != v.shape or Bk != B or Dk != D:
        raise ValueError(f"k and v must both be (batch={B}, seq, kv_heads, head_dim={D}), got "
                         f"k {tuple(k.shape)} and v {tuple(v.shape)}.")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}).")
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"triton attention supports head dims {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, "
                         f"got {D}.")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype of float16/bfloat16/float32, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}.")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"triton attention needs CUDA tensors (got {q.device}); on a CPU set "
                         f"TRITON_INTERPRET=1 before importing triton to use the interpreter.")
    if min(B, Sq, Sk) == 0:
        raise ValueError(f"empty attention block: batch {B}, {Sq} queries, {Sk} keys.")
    if B * max(Hq, Hkv) > MAX_GRID_Y:
        raise ValueError(f"batch x heads = {B * max(Hq, Hkv)} exceeds the grid limit "
                         f"{MAX_GRID_Y}; split the batch.")
    return B, Sq, Hq, D, Sk, Hkv


def mask_plan(sq, sk, causal, q_start, k_start, doc_bounds) -> tuple[int, int, tuple | None]:
    """(mask mode, causal offset q_start - k_start, doc bounds still needed or None);
    ValueError if the block reaches beyond the last document bound."""
    bounds = tuple(int(x) for x in doc_bounds) if doc_bounds is not None else None
    if bounds is not None:
        end = max(q_start + sq, k_start + sk)
        if end > bounds[-1] or q_start < 0 or k_start < 0:
            raise ValueError(f"block spans positions up to {end - 1} but cu_seqlens covers "
                             f"[0, {bounds[-1]}); the documents must cover the whole sequence.")
        ends = (q_start, q_start + sq - 1, k_start, k_start + sk - 1)
        if len({bisect.bisect_right(bounds, p) for p in ends}) > 1:
            return MASK_RANGES, q_start - k_start, bounds
    if causal and k_start + sk - 1 > q_start:
        return MASK_CAUSAL, q_start - k_start, None
    return MASK_NONE, q_start - k_start, None


def _buffer(buf, shape, dtype, like: torch.Tensor, name: str) -> torch.Tensor:
    """A fresh output buffer, or the caller's one after checking it."""
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if tuple(buf.shape) != tuple(shape) or buf.device != like.device or buf.stride(-1) != 1:
        raise ValueError(f"{name}= must be a {tuple(shape)} tensor on {like.device} with a "
                         f"contiguous last dim, got {tuple(buf.shape)} on {buf.device}.")
    if not buf.is_floating_point():
        raise ValueError(f"{name}= must be a floating-point tensor, got {buf.dtype}.")
    return buf


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the TMA descriptors the kernels build on the device (Triton asks)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may read these tensors' tiles with TMA copies (sm_90+, or the
    interpreter, which runs that path too; 16-byte aligned addresses and strides)."""
    if not interpreting():
        if tensors[0].device.type != "cuda" or torch.cuda.get_device_capability(
                tensors[0].device)[0] < 9:
            return False
    for x in tensors:
        elt = x.element_size()
        if x.data_ptr() % 16 or any(st * elt % 16 for st in x.stride()[:-1]):
            return False
    return True


def _use_tma(tma: bool | None, *tensors: torch.Tensor) -> bool:
    """TMA where :func:`tma_ok` allows it (``tma=None``), never (False), or required (True)."""
    if tma is False:
        return False
    ok = tma_ok(*tensors)
    if tma and not ok:
        raise ValueError("tma=True but these inputs cannot be read with TMA copies (that needs "
                         "an sm_90+ GPU or the interpreter, and 16-byte aligned addresses and "
                         "strides); pass tma=None to choose automatically.")
    return ok


def _flags(dtype, tma: bool) -> dict:
    """Constexprs that depend on dtype, on TMA and on the interpreter."""
    interp = interpreting()
    if interp:
        prec = "ieee"  # exact products on the CPU (also for bf16 upcast to float32)
    elif dtype == torch.float32:
        prec = "tf32x3"  # near-fp32 products on tensor cores
    else:
        prec = "tf32"  # the default; unused for 16-bit operands
    if tma and not interp:
        triton.set_allocator(_scratch)  # cheap; a context variable of the calling thread
    return {"UPCAST": interp and dtype == torch.bfloat16, "DOT_PREC": prec, "TMA": tma}


def _launch(tuned, raw, kind: str, grid, args: dict, config: dict | None) -> None:
    """Autotuned launch, or one fixed config (given, or the interpreter's)."""
    if config is None and interpreting():
        config = INTERPRET_CONFIGS[kind]
    if config is not None:
        raw[grid](**{**args, **config})
        return
    if args["Q"].dtype == torch.float32:
        tuned = FP32_TUNED[kind]
    try:
        tuned[grid](**args)
    except OutOfResources:  # the footprint model was optimistic for this GPU / Triton
        raw[grid](**{**args, **SAFE_CONFIG})


def _mask_arrays(plan, sq, sk, q_start, k_start, causal, device, placeholder, for_keys):
    mode, _, bounds = plan
    if mode != MASK_RANGES:
        return placeholder, placeholder  # never read by the kernel
    return interval_arrays(sq, sk, q_start, k_start, causal, bounds, device, for_keys=for_keys)


def _strides3(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _strides(**tensors: torch.Tensor) -> dict:
    """The kernels' ``stride_<name>b``, ``_<name>s`` and ``_<name>h`` of (B, S, H, D) tensors."""
    return {f"stride_{n}{a}": st for n, t in tensors.items() for a, st in zip("bsh", _strides3(t))}


def flash_forward(q, k, v, *, scale: float | None = None, causal: bool = False,
                  q_start: int = 0, k_start: int = 0, doc_bounds=None, out=None, lse=None,
                  config: dict | None = None, tma: bool | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block, q (B, Sq, Hq, D) against k, v (B, Sk, Hkv, D) under the
    mask ``causal, q_start, k_start, doc_bounds``, into optional ``out`` and float32 ``lse``
    buffers; ``config`` fixes the tiles instead of autotuning, ``tma`` uses TMA copies where
    possible (None), never (False) or always (True)."""
    B, Sq, Hq, D, Sk, Hkv = check_inputs(q, k, v)
    scale = D ** -0.5 if scale is None else float(scale)
    plan = mask_plan(Sq, Sk, causal, q_start, k_start, doc_bounds)
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    out = _buffer(out, q.shape, q.dtype, q, "out")  # (B, Sq, Hq, D)
    lse = _buffer(lse, (B, Hq, Sq), torch.float32, q, "lse")  # (B, Hq, Sq)
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError("lse= must be a contiguous float32 tensor.")
    kv_lo, kv_hi = _mask_arrays(plan, Sq, Sk, q_start, k_start, causal, q.device, lse, False)
    args = dict(Q=q, K=k, V=v, Out=out, Lse=lse, KV_LO=kv_lo, KV_HI=kv_hi, sm_scale=scale,
                causal_off=plan[1], **_strides(q=q, k=k, v=v, o=out), Hq=Hq, GROUP=Hq // Hkv,
                Sq=Sq, Sk=Sk, SEQ_BUCKET=seq_bucket(Sq, Sk), HEAD_DIM=D,
                HEAD_DIM_PAD=max(16, triton.next_power_of_2(D)), MASK_MODE=plan[0],
                WARP_SPECIALIZE=False,
                **_flags(q.dtype, _use_tma(tma, q, k, v)))
    grid = lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    _launch(fwd_tuned, attn_fwd_kernel, "fwd", grid, args, config)
    return out, lse


def _delta(o, do, lse_shape, dlse) -> torch.Tensor:
    """delta = rowsum(dO * O) - dlse, (B, Hq, Sq) float32."""
    B, Sq, Hq, D = o.shape
    delta = torch.empty(lse_shape, dtype=torch.float32, device=o.device)
    block = 32 if interpreting() else 64
    attn_bwd_delta_kernel[(triton.cdiv(Sq, block), B * Hq)](
        o, do, delta, *_strides3(o), *_strides3(do), Hq, Sq,
        HEAD_DIM=D, HEAD_DIM_PAD=max(16, triton.next_power_of_2(D)), BLOCK_M=block)
    if dlse is not None:
        delta -= dlse.to(torch.float32)
    return delta


def flash_backward(do, q, k, v, out, lse, *, scale: float | None = None, causal: bool = False,
                   q_start: int = 0, k_start: int = 0, doc_bounds=None, dlse=None,
                   dq=None, dk=None, dv=None, dq_config: dict | None = None,
                   dkdv_config: dict | None = None, tma: bool | None = None):
    """``(dq, dk, dv)`` of one block from the FINAL (merged) ``out`` and ``lse`` of its rows and
    the optional gradient ``dlse`` of the lse, into optional buffers; the other arguments as
    :func:`flash_forward`'s, a config for each of the two kernels."""
    B, Sq, Hq, D, Sk, Hkv = check_inputs(q, k, v)
    if do.shape != q.shape or out.shape != q.shape or tuple(lse.shape) != (B, Hq, Sq):
        raise ValueError(f"do and out must be {tuple(q.shape)} and lse {(B, Hq, Sq)}, got "
                         f"{tuple(do.shape)}, {tuple(out.shape)}, {tuple(lse.shape)}.")
    scale = D ** -0.5 if scale is None else float(scale)
    plan = mask_plan(Sq, Sk, causal, q_start, k_start, doc_bounds)
    q, k, v, do, out = (last_dim_contiguous(x) for x in (q, k, v, do, out))
    lse = lse.to(torch.float32).contiguous()
    delta = _delta(out, do, lse.shape, dlse)  # (B, Hq, Sq)
    dq = _buffer(dq, q.shape, q.dtype, q, "dq")
    dk = _buffer(dk, k.shape, k.dtype, q, "dk")
    dv = _buffer(dv, v.shape, v.dtype, q, "dv")
    common = dict(Q=q, K=k, V=v, DO=do, Lse=lse, Delta=delta, sm_scale=scale,
                  causal_off=plan[1], **_strides(q=q, k=k, v=v, d=do), Hq=Hq, GROUP=Hq // Hkv,
                  Sq=Sq, Sk=Sk, SEQ_BUCKET=seq_bucket(Sq, Sk), HEAD_DIM=D,
                  HEAD_DIM_PAD=max(16, triton.next_power_of_2(D)), MASK_MODE=plan[0],
                  **_flags(q.dtype, _use_tma(tma, q, k, v, do)))
    q_lo, q_hi = _mask_arrays(plan, Sq, Sk, q_start, k_start, causal, q.device, lse, True)
    dkdv_args = dict(common, DK=dk, DV=dv, Q_LO=q_lo, Q_HI=q_hi, Hkv=Hkv, **_strides(dk=dk, dv=dv))
    grid = lambda meta: (triton.cdiv(Sk, meta["BLOCK_N"]), B * Hkv)  # noqa: E731
    _launch(dkdv_tuned, attn_bwd_dkdv_kernel, "dkdv", grid, dkdv_args, dkdv_config)
    kv_lo, kv_hi = _mask_arrays(plan, Sq, Sk, q_start, k_start, causal, q.device, lse, False)
    dq_args = dict(common, DQ=dq, KV_LO=kv_lo, KV_HI=kv_hi, **_strides(dq=dq))
    grid = lambda meta: (triton.cdiv(Sq, meta["BLOCK_M"]), B * Hq)  # noqa: E731
    _launch(dq_tuned, attn_bwd_dq_kernel, "dq", grid, dq_args, dq_config)
    return dq, dk, dv
