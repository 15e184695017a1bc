"""Block entry points + merge rebuild whole attention, exactly as the distributed executor does.

Keys split into pieces: each piece is one block (global positions in its MaskSpec), partial
results merged through their lse; the backward of each block takes the MERGED out and lse and
the pieces' gradients add up. Queries split: the blocks' results concatenate.
"""
import pytest
import torch

from lctrain_kernels.backends import block_backward, block_forward
from lctrain_kernels.combine import merge, merge_many_into
from lctrain_kernels.masks import MaskSpec
from lctrain_kernels.reference import reference_backward, reference_forward

NEG_INF = float("-inf")


def cuts(n: int, pieces: int) -> list[int]:
    inner = torch.randperm(n - 1)[: pieces - 1] + 1
    return [0, *sorted(inner.tolist()), n]


def qkv(b, s, hq, hkv, d, dtype=torch.float64):
    return (torch.randn(b, s, hq, d, dtype=dtype), torch.randn(b, s, hkv, d, dtype=dtype),
            torch.randn(b, s, hkv, d, dtype=dtype))


SPLITS = [  # causal, doc_bounds, S, Hq, Hkv
    (True, None, 48, 4, 2),
    (False, None, 30, 2, 2),
    (True, (0, 5, 21, 22, 48), 48, 4, 1),
    (False, (0, 17, 40), 40, 2, 1),
]


@pytest.mark.parametrize("causal, bounds, s, hq, hkv", SPLITS)
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_key_pieces_merged_equal_whole_attention(causal, bounds, s, hq, hkv, backend):
    q, k, v = qkv(2, s, hq, hkv, 16)
    whole = MaskSpec(causal, doc_bounds=bounds)
    ref_out, ref_lse = reference_forward(q, k, v, whole, 0.3)
    acc_out = torch.zeros(q.shape, dtype=torch.float64)  # merge accumulator
    acc_lse = torch.full(ref_lse.shape, NEG_INF, dtype=torch.float64)
    pieces = cuts(s, 4)
    skipped = 0
    for a, c in zip(pieces, pieces[1:]):
        spec = MaskSpec(causal, 0, a, bounds)
        result = block_forward(q, k[:, a:c], v[:, a:c], spec, scale=0.3, backend=backend)
        if result is None:
            skipped += 1
            continue
        merge_many_into(acc_out, acc_lse, [(acc_out, acc_lse), result])
    torch.testing.assert_close(acc_out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(acc_lse, ref_lse, rtol=1e-9, atol=1e-9)

    dout = torch.randn_like(q)
    ref = reference_backward(dout, q, k, v, ref_out, ref_lse, whole, 0.3)
    dq = torch.zeros_like(q)
    dks, dvs = [], []
    for a, c in zip(pieces, pieces[1:]):
        spec = MaskSpec(causal, 0, a, bounds)
        grads = block_backward(dout, q, k[:, a:c], v[:, a:c], acc_out, acc_lse, spec, scale=0.3,
                               backend=backend)
        if grads is None:
            grads = (0, torch.zeros_like(k[:, a:c]), torch.zeros_like(v[:, a:c]))
        dq += grads[0]
        dks.append(grads[1])
        dvs.append(grads[2])
    for got, want in zip((dq, torch.cat(dks, 1), torch.cat(dvs, 1)), ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal, bounds, s, hq, hkv", SPLITS)
def test_query_pieces_concatenate_to_whole_attention(causal, bounds, s, hq, hkv):
    q, k, v = qkv(1, s, hq, hkv, 8)
    whole = MaskSpec(causal, doc_bounds=bounds)
    ref_out, ref_lse = reference_forward(q, k, v, whole, 0.5)
    dout = torch.randn_like(q)
    ref = reference_backward(dout, q, k, v, ref_out, ref_lse, whole, 0.5)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    pieces = cuts(s, 3)
    for a, c in zip(pieces, pieces[1:]):
        spec = MaskSpec(causal, a, 0, bounds)
        out, lse = block_forward(q[:, a:c], k, v, spec, scale=0.5, backend="reference")
        torch.testing.assert_close(out, ref_out[:, a:c], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, ref_lse[:, :, a:c], rtol=1e-10, atol=1e-10)
        dq, dk_i, dv_i = block_backward(dout[:, a:c], q[:, a:c], k, v, out, lse, spec,
                                        scale=0.5, backend="reference")
        torch.testing.assert_close(dq, ref[0][:, a:c], rtol=1e-9, atol=1e-9)
        dk += dk_i
        dv += dv_i
    torch.testing.assert_close(dk, ref[1], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dv, ref[2], rtol=1e-9, atol=1e-9)


def test_empty_block_returns_none_before_choosing_a_backend():
    q, k, v = qkv(1, 8, 2, 2, 8)
    spec = MaskSpec(True, q_start=0, k_start=8)  # keys after every query
    # "no-such-backend" would raise if a backend were looked up at all
    assert block_forward(q, k, v, spec, scale=1.0, backend="no-such-backend") is None
    assert block_backward(q, q, k, v, q, q[..., 0].transpose(1, 2), spec, scale=1.0,
                          backend="no-such-backend") is None


def test_merge_handles_rows_that_saw_nothing():
    out_a, out_b = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    lse_a, lse_b = torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    lse_a[0, 0, 0] = NEG_INF  # piece a saw nothing in this row ...
    out_a[0, 0, 0] = 0
    lse_a[0, 1, 2] = lse_b[0, 1, 2] = NEG_INF  # ... neither piece saw anything here
    out_a[0, 2, 1] = out_b[0, 2, 1] = 0
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out[0, 0, 0], out_b[0, 0, 0])
    assert lse[0, 0, 0] == lse_b[0, 0, 0]
    assert lse[0, 1, 2] == NEG_INF and (out[0, 2, 1] == 0).all()
    # merging into an empty accumulator reproduces the piece
    acc_out, acc_lse = torch.zeros(1, 4, 2, 8), torch.full((1, 2, 4), NEG_INF)
    merge_many_into(acc_out, acc_lse, [(acc_out, acc_lse), (out_a, lse_a)])
    torch.testing.assert_close(acc_out, out_a)
    torch.testing.assert_close(acc_lse, lse_a)


def test_merge_is_stable_for_far_apart_lse_and_matches_the_formula():
    out_a, out_b = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    lse_a = torch.randn(2, 3, 5) * 50
    lse_b = lse_a + torch.tensor([-200.0, -1.0, 0.0, 1.0, 200.0])  # extreme gaps, no overflow
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    want_lse = torch.logaddexp(lse_a.double(), lse_b.double())
    w_a = torch.exp(lse_a.double() - want_lse).transpose(1, 2)[..., None]
    w_b = torch.exp(lse_b.double() - want_lse).transpose(1, 2)[..., None]
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out.double(), out_a * w_a + out_b * w_b, rtol=1e-5, atol=1e-6)
    assert out.dtype == torch.float32  # fp32 merge even for half inputs
    assert merge(out_a.bfloat16(), lse_a, out_b.bfloat16(), lse_b)[0].dtype == torch.float32


def test_merge_rejects_mismatched_shapes():
    out, lse = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="different shapes"):
        merge(out, lse, out[:, :3], lse[..., :3])
    with pytest.raises(ValueError, match=r"\(B, H, S\)"):
        merge(out, lse.transpose(1, 2), out, lse.transpose(1, 2))
    with pytest.raises(ValueError, match="cannot merge an lse"):
        merge_many_into(out, lse, [(out, lse.transpose(1, 2))])
