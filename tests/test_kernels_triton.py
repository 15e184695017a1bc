"""Our Triton flash attention (interpreter on CPU) against float64 reference math.

The reference is written out here: softmax(Q K^T * scale + mask) V with K/V repeated over the
GQA group, lse = logsumexp, gradients (of a loss on out AND lse) by float64 autograd. Masks are built from global
positions (causal: key <= query; documents: same document). Shapes are tiny (S <= 200) so the
interpreter stays fast; the tiles are the real ones (several per sequence).
"""
from __future__ import annotations

import math

import pytest
import torch

from lctrain_kernels.triton.launch import flash_backward, flash_forward, tma_ok


@pytest.fixture(params=["tma", "pointers"])
def tma(request) -> bool:
    """A kernel test runs twice: tiles read with TMA copies (the path taken for aligned inputs on
    Hopper, and by the interpreter) and with per-thread loads (older GPUs, unaligned inputs);
    the launchers' ``tma`` argument picks the path."""
    return request.param == "tma"


def make_mask(sq, sk, causal, q_start=0, k_start=0, doc_bounds=None, device="cpu"):
    qpos = torch.arange(q_start, q_start + sq, device=device)[:, None]  # (sq, 1)
    kpos = torch.arange(k_start, k_start + sk, device=device)[None, :]  # (1, sk)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        mask &= kpos <= qpos
    if doc_bounds is not None:
        b = torch.tensor(doc_bounds, device=device)
        mask &= torch.bucketize(qpos, b, right=True) == torch.bucketize(kpos, b, right=True)
    return mask


def reference(q, k, v, mask, scale):
    """float64 (out (B,Sq,Hq,D), lse (B,Hq,Sq)); differentiable in q, k, v."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, 2)
    v = v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (B, H, Sq, Sk)
    seen = mask.any(-1)  # (Sq,) rows that see at least one key
    s = torch.where(mask & seen[:, None], s, torch.where(seen[:, None], -math.inf, 0.0))
    lse = torch.logsumexp(s, -1)  # (B, H, Sq)
    p = torch.exp(s - lse[..., None]) * seen[:, None]
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, torch.where(seen, lse, -math.inf)


def inputs(B, sq, sk, hq, hkv, d, dtype, device="cpu"):
    q = torch.randn(B, sq, hq, d, dtype=dtype, device=device)
    k = torch.randn(B, sk, hkv, d, dtype=dtype, device=device)
    v = torch.randn(B, sk, hkv, d, dtype=dtype, device=device)
    return q, k, v


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def check_block(B, sq, sk, hq, hkv, d, dtype, causal, q_start=0, k_start=0, doc_bounds=None,
                tol=None, backward=True, device="cpu", tma=None, **cfg):
    if tma and device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA copies need an sm_90+ GPU")
    tol = tol if tol is not None else {torch.float32: 2e-5, torch.float16: 4e-3,
                                       torch.bfloat16: 3e-2}[dtype]
    q, k, v = inputs(B, sq, sk, hq, hkv, d, dtype, device)
    mask = make_mask(sq, sk, causal, q_start, k_start, doc_bounds, device)
    scale = 0.7 / math.sqrt(d)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qd, kd, vd, mask, scale)
    mask_kw = dict(scale=scale, causal=causal, q_start=q_start, k_start=k_start,
                   doc_bounds=doc_bounds, tma=tma)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    lse = torch.full((B, hq, sq), float("nan"), device=device)
    out, lse = flash_forward(q, k, v, out=out, lse=lse, config=cfg.get("fwd"), **mask_kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out, ref_out.detach()) < tol
    seen = mask.any(-1)
    assert torch.equal(lse[..., ~seen], torch.full_like(lse[..., ~seen], -math.inf))
    assert torch.equal(out[:, ~seen], torch.zeros_like(out[:, ~seen]))
    if seen.any():
        assert (lse[..., seen].double() - ref_lse.detach()[..., seen]).abs().max() < tol * 10
    if not backward:
        return
    do = torch.randn_like(q)
    dlse = torch.randn(B, hq, sq, device=device) * seen  # the lse is differentiable too
    torch.autograd.backward([ref_out, ref_lse], [do.double(), dlse.double()])
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    dq, dk, dv = flash_backward(do, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                dlse=dlse, dq_config=cfg.get("dq"),
                                dkdv_config=cfg.get("dkdv"), **mask_kw)
    assert dq is grads[0] and dq.dtype == dtype
    for name, got, ref in (("dq", dq, qd.grad), ("dk", dk, kd.grad), ("dv", dv, vd.grad)):
        assert not got.isnan().any(), name
        assert rel_err(got, ref) < tol * 4, (name, rel_err(got, ref))


def test_causal_gqa_odd_length_fp32(tma):
    check_block(1, 100, 100, 4, 2, 64, torch.float32, causal=True, tma=tma)


def test_full_ragged_padded_head_dim_fp32(tma):
    check_block(2, 37, 100, 2, 1, 80, torch.float32, causal=False, tma=tma)


def test_offset_causal_block_fp32(tma):
    # queries 150..213 against keys 100..229: a shifted diagonal with a fully visible prefix
    check_block(1, 64, 130, 2, 2, 32, torch.float32, causal=True, q_start=150, k_start=100,
                tma=tma)


def test_rows_that_see_nothing_fp32(tma):
    # keys start after the first 20 queries: those rows give out 0 and lse -inf, and no NaN
    check_block(1, 50, 40, 2, 1, 64, torch.float32, causal=True, q_start=0, k_start=20, tma=tma)


def test_documents_causal_fp32(tma):
    # a document of length 1 and boundaries that cross the 64 / 32 tiles
    check_block(1, 200, 200, 2, 1, 64, torch.float32, causal=True,
                doc_bounds=(0, 30, 31, 97, 160, 200), tma=tma)


def test_documents_offset_noncausal_fp32(tma):
    check_block(1, 120, 200, 4, 2, 32, torch.float32, causal=False, q_start=40, k_start=0,
                doc_bounds=(0, 30, 31, 97, 160, 200), tma=tma)


def test_causal_gqa_fp16(tma):
    check_block(1, 128, 128, 4, 2, 64, torch.float16, causal=True, tma=tma)


def test_documents_fp16_d96(tma):
    check_block(1, 90, 90, 2, 2, 96, torch.float16, causal=True, doc_bounds=(0, 1, 45, 90),
                tma=tma)


def test_bf16_forward_under_interpreter_upcast(tma):
    check_block(1, 70, 70, 2, 1, 64, torch.bfloat16, causal=True, tma=tma)


def test_explicit_tiles_with_wide_key_tiles(tma):
    tiles = {"fwd": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1},
             "dq": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1},
             "dkdv": {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}}
    check_block(1, 77, 77, 2, 1, 32, torch.float32, causal=True,
                doc_bounds=(0, 20, 77), **tiles, tma=tma)


def test_unaligned_inputs_take_the_pointer_path():
    """TMA needs 16-byte aligned addresses and strides; a view that breaks that is refused by
    the real check and still computed correctly (by the per-thread loads)."""
    q, k, v = inputs(1, 40, 40, 2, 2, 32, torch.float32)
    shifted = torch.empty(q.numel() + 1)[1:].view_as(q).copy_(q)  # 4 bytes off alignment
    assert tma_ok(q, k, v) and not tma_ok(shifted, k, v)
    assert not tma_ok(q, torch.randn(1, 40, 2, 33)[..., :32], v)  # head stride 132 bytes
    mask = make_mask(40, 40, True)
    ref_out, ref_lse = reference(q.double(), k.double(), v.double(), mask, 32 ** -0.5)
    out, lse = flash_forward(shifted, k, v, causal=True)
    assert rel_err(out, ref_out) < 2e-5 and rel_err(lse, ref_lse) < 2e-5
    with pytest.raises(ValueError, match="tma=True but these inputs cannot be read"):
        flash_forward(shifted, k, v, causal=True, tma=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", [
    dict(B=2, sq=1000, sk=1000, hq=8, hkv=2, d=128, causal=True),
    dict(B=1, sq=700, sk=1300, hq=4, hkv=4, d=80, causal=True, q_start=900, k_start=300),
    dict(B=1, sq=1024, sk=1024, hq=4, hkv=1, d=64, causal=True,
         doc_bounds=(0, 1, 300, 301, 777, 1024)),
])
def test_gpu_kernels_against_float64(case, dtype, tma):
    """The compiled kernels (autotuned) on a GPU; float32 runs tf32x3 products."""
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    check_block(dtype=dtype, device="cuda", tol=tol, **case, tma=tma)


@pytest.mark.parametrize("bad, match", [
    (dict(hkv=4), "multiple of key/value heads"),
    (dict(d=512), "head dims"),
    (dict(kdtype=torch.float16), "share one dtype"),
])
def test_clear_errors(bad, match):
    hq, hkv, d = 6, bad.get("hkv", 2), bad.get("d", 32)
    q = torch.randn(1, 8, hq, d)
    k = torch.randn(1, 8, hkv, d, dtype=bad.get("kdtype", torch.float32))
    with pytest.raises(ValueError, match=match):
        flash_forward(q, k, k.clone(), causal=True)


def test_documents_must_cover_the_block():
    q = torch.randn(1, 16, 2, 32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_forward(q, q, q, causal=True, doc_bounds=(0, 8, 12))
