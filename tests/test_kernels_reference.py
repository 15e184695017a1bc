"""The reference attention against plain float64 autograd math, for every kind of block."""
import pytest
import torch

from lctrain_kernels.masks import MaskSpec
from lctrain_kernels.reference import reference_backward, reference_forward


def visible(spec: MaskSpec, sq: int, sk: int) -> torch.Tensor:
    """(sq, sk) bool straight from the definition (independent of masks.dense_mask)."""
    qi = torch.arange(sq)[:, None] + spec.q_start
    kj = torch.arange(sk)[None, :] + spec.k_start
    vis = torch.ones(sq, sk, dtype=torch.bool)
    if spec.causal:
        vis &= kj <= qi
    if spec.doc_bounds is not None:
        doc = torch.zeros(spec.doc_bounds[-1], dtype=torch.long)
        for b in spec.doc_bounds[1:-1]:
            doc[b:] += 1
        vis &= doc[qi] == doc[kj]
    return vis


def oracle(q, k, v, spec, scale):
    """float64 (out, lse) with autograd; K/V heads repeated explicitly; empty rows -> 0, -inf."""
    g = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = s.masked_fill(~visible(spec, q.shape[1], k.shape[1]), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Sq)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse


def inputs(b, sq, sk, hq, hkv, d, dtype=torch.float64):
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, dtype=dtype)
    v = torch.randn(b, sk, hkv, d, dtype=dtype)
    return q, k, v


def oracle_grads(q, k, v, spec, scale, dout):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, _ = oracle(q, k, v, spec, scale)
    return torch.autograd.grad(out, (q, k, v), dout.double())


CASES = {  # name: (B, Sq, Sk, Hq, Hkv, D, spec)
    "causal": (2, 33, 33, 4, 4, 16, MaskSpec(True)),
    "full": (1, 20, 27, 2, 2, 32, MaskSpec(False)),
    "documents": (2, 40, 40, 4, 2, 16, MaskSpec(True, doc_bounds=(0, 7, 8, 25, 40))),
    "documents_noncausal": (1, 40, 40, 2, 1, 16, MaskSpec(False, doc_bounds=(0, 13, 40))),
    "gqa_odd_s": (1, 37, 37, 6, 2, 8, MaskSpec(True)),
    "mqa_d80": (1, 19, 19, 4, 1, 80, MaskSpec(True)),
    "offset_diagonal": (1, 16, 24, 2, 1, 16, MaskSpec(True, q_start=40, k_start=30)),
    "offset_docs_empty_rows": (2, 24, 20, 2, 2, 16,
                               MaskSpec(True, q_start=10, k_start=14, doc_bounds=(0, 12, 30, 60))),
    "empty": (1, 8, 8, 2, 2, 16, MaskSpec(True, q_start=0, k_start=8)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_float64_math(name):
    b, sq, sk, hq, hkv, d, spec = CASES[name]
    q, k, v = inputs(b, sq, sk, hq, hkv, d)
    scale = d ** -0.5 * 1.3
    out, lse = reference_forward(q, k, v, spec, scale, max_scores=b * hq * sk * 5)  # chunked
    ref_out, ref_lse = oracle(q, k, v, spec, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    empty_rows = torch.isinf(ref_lse)  # (B, H, Sq)
    assert (out.transpose(1, 2)[empty_rows] == 0).all()

    dout = torch.randn_like(q)
    grads = reference_backward(dout, q, k, v, out, lse, spec, scale, max_scores=b * hq * sk * 5)
    for got, want, what in zip(grads, oracle_grads(q, k, v, spec, scale, dout), "qkv"):
        assert got.shape == want.shape, what
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"d{what}")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_reference_in_low_precision_keeps_float32_math(dtype, tol):
    b, sq, sk, hq, hkv, d, spec = CASES["documents"]
    q, k, v = inputs(b, sq, sk, hq, hkv, d, dtype)
    out, lse = reference_forward(q, k, v, spec, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = oracle(q.double(), k.double(), v.double(), spec, 0.25)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(q)
    grads = reference_backward(dout, q, k, v, out, lse, spec, 0.25)
    for got, want in zip(grads, oracle_grads(q, k, v, spec, 0.25, dout)):
        assert got.dtype == dtype
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < 4 * tol


def test_chunking_does_not_change_the_result():
    b, sq, sk, hq, hkv, d, spec = CASES["documents"]
    q, k, v = inputs(b, sq, sk, hq, hkv, d, torch.float32)
    whole = reference_forward(q, k, v, spec, 0.3)
    rows_of_one = reference_forward(q, k, v, spec, 0.3, max_scores=1)
    for a, c in zip(whole, rows_of_one):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)
