"""The single-pass backward (dQ by reduce-add, ``launch_tma.py``) against float64 reference math.

On the CPU the interpreter runs the same kernel with an element-wise atomic add in place of
the TMA reduce (the interpreter has no descriptor reduce); the ``gpu`` tests run the TMA path.
Inputs are fresh random draws, outputs are poisoned with NaN before the kernels write them.
"""
from __future__ import annotations

import math

import pytest
import torch

from lctrain_kernels.masks import MaskSpec
from lctrain_kernels.reference import reference_backward, reference_forward
from lctrain_kernels.triton.launch import flash_forward
from lctrain_kernels.triton.launch_tma import flash_backward_tma

TOL = {torch.float32: 1e-4, torch.float16: 1.6e-2, torch.bfloat16: 1.2e-1}


def rel_err(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12)
            ).item()


def check(B, sq, sk, hq, hkv, d, dtype, causal, q_start=0, k_start=0, doc_bounds=None,
          device="cpu", config=None):
    q = torch.randn(B, sq, hq, d, dtype=dtype, device=device)
    k = torch.randn(B, sk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(B, sk, hkv, d, dtype=dtype, device=device)
    do = torch.randn_like(q)
    scale = 0.7 / math.sqrt(d)
    spec = MaskSpec(causal=causal, q_start=q_start, k_start=k_start, doc_bounds=doc_bounds)
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, do))
    out64, lse64 = reference_forward(q64, k64, v64, spec, scale)
    ref = reference_backward(do64, q64, k64, v64, out64, lse64, spec, scale)
    mask_kw = dict(scale=scale, causal=causal, q_start=q_start, k_start=k_start,
                   doc_bounds=doc_bounds)
    out, lse = flash_forward(q, k, v, **mask_kw)
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    got = flash_backward_tma(do, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                             config=config, **mask_kw)
    assert all(g is b for g, b in zip(got, grads))
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.dtype == dtype and not g.isnan().any(), name
        assert rel_err(g, r) < TOL[dtype], (name, rel_err(g, r))


def test_causal_gqa_odd_length_fp32():
    check(1, 100, 100, 4, 2, 64, torch.float32, causal=True)


def test_noncausal_ragged_padded_head_dim_fp32():
    check(2, 37, 100, 2, 1, 80, torch.float32, causal=False)


def test_offset_causal_rows_that_see_nothing_fp32():
    # keys start 20 positions after the first query: those rows get dq = 0, no NaN
    check(1, 50, 70, 2, 1, 32, torch.float32, causal=True, q_start=0, k_start=20)


def test_documents_causal_gqa_fp32():
    # a document of length 1 and boundaries that cross the tiles
    check(1, 150, 150, 4, 2, 32, torch.float32, causal=True, doc_bounds=(0, 30, 31, 97, 150))


def test_documents_offset_noncausal_fp16():
    check(1, 90, 120, 2, 2, 64, torch.float16, causal=False, q_start=30,
          doc_bounds=(0, 1, 45, 120))


def test_bf16_causal_wide_query_tiles():
    check(1, 70, 70, 2, 1, 64, torch.bfloat16, causal=True,
          config={"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [
    dict(B=2, sq=1000, sk=1000, hq=8, hkv=2, d=128, causal=True),
    dict(B=1, sq=700, sk=1300, hq=4, hkv=4, d=80, causal=True, q_start=900, k_start=300),
    dict(B=1, sq=1024, sk=1024, hq=4, hkv=1, d=64, causal=True,
         doc_bounds=(0, 1, 300, 301, 777, 1024)),
])
def test_gpu_tma_against_float64(case, dtype):
    """The TMA reduce-add path, compiled, with the default tiles."""
    check(dtype=dtype, device="cuda", **case)


@pytest.mark.gpu
def test_gpu_float32_is_refused():
    q = torch.randn(1, 16, 2, 32, device="cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        flash_backward_tma(q, q, q, q, q, torch.zeros(1, 2, 16, device="cuda"))
