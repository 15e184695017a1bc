"""attention / attention_with_lse: values and gradients (of out and lse) against float64 SDPA for
the backends that run on a CPU, and input checks."""
import pytest
import torch
import torch.nn.functional as F

from lctrain_kernels.api import attention, attention_with_lse
from lctrain_kernels.backends import BackendUnavailable


def sdpa_oracle(q, k, v, causal, bounds, scale):
    """(out, lse) with torch's own float64 math attention and an explicit boolean mask."""
    s, g = q.shape[1], q.shape[2] // k.shape[2]
    pos = torch.arange(s)
    mask = torch.ones(s, s, dtype=torch.bool)
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    if bounds is not None:
        doc = torch.bucketize(pos, torch.tensor(bounds), right=True)
        mask &= doc[:, None] == doc[None, :]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(g, 2),
                                               v.repeat_interleave(g, 2)))
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    scores = (qt @ kt.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return out.transpose(1, 2), torch.logsumexp(scores, -1)


def leaves(b, s, hq, hkv, d, dtype=torch.float64):
    return [torch.randn(b, s, h, d, dtype=dtype, requires_grad=True) for h in (hq, hkv, hkv)]


def all_grads(fn, q, k, v, g_out, g_lse):
    out, lse = fn(q, k, v)
    loss = (out.double() * g_out).sum() + (lse.double() * g_lse).sum()
    return (out, lse), torch.autograd.grad(loss, (q, k, v))


CASES = [  # causal, bounds, s, hq, hkv, d
    (True, None, 29, 4, 2, 16),
    (False, None, 24, 2, 2, 80),
    (True, [0, 6, 7, 20, 31], 31, 4, 1, 16),
    (False, [0, 10, 24], 24, 3, 1, 8),
]


@pytest.mark.parametrize("causal, bounds, s, hq, hkv, d, backend", [
    (*case, backend) for case in CASES for backend in ("auto", "reference", "cpu_flash")
    if backend != "cpu_flash" or case[1] is None  # cpu_flash: no document masks
])
def test_values_and_all_gradients_match_float64_sdpa(causal, bounds, s, hq, hkv, d, backend):
    q, k, v = leaves(2, s, hq, hkv, d)
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    g_out = torch.randn(2, s, hq, d, dtype=torch.float64)
    g_lse = torch.randn(2, hq, s, dtype=torch.float64)  # the lse is differentiable too
    (out, lse), grads = all_grads(
        lambda *x: attention_with_lse(*x, causal=causal, cu_seqlens=cu, softmax_scale=0.2,
                                      backend=backend), q, k, v, g_out, g_lse)
    (ref_out, ref_lse), ref_grads = all_grads(
        lambda *x: sdpa_oracle(*x, causal, bounds, 0.2), q, k, v, g_out, g_lse)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-9, atol=1e-9)
    for got, want, name in zip(grads, ref_grads, "qkv"):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8, msg=f"d{name}")
    plain = attention(q, k, v, causal=causal, cu_seqlens=cu, softmax_scale=0.2, backend=backend)
    assert torch.equal(plain, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_error_is_within_twice_torchs_own(dtype):
    """bf16/fp16 may err at most 2x as much as torch's own SDPA in that dtype, plus one rounding
    step of the dtype at the result's scale (torch's own error can be lucky on a small draw)."""
    q, k, v = leaves(1, 64, 4, 2, 32, dtype)
    g_out = torch.randn(1, 64, 4, 32, dtype=torch.float64)
    ref = all_grads(lambda *x: sdpa_oracle(*x, True, None, 32 ** -0.5),
                    *(x.detach().double().requires_grad_() for x in (q, k, v)), g_out, 0)
    ours = all_grads(lambda *x: attention_with_lse(*x), q, k, v, g_out, 0)
    torch_own = all_grads(lambda *x: sdpa_oracle(*x, True, None, 32 ** -0.5), q, k, v, g_out, 0)
    for got, base, want in zip([ours[0][0], *ours[1]], [torch_own[0][0], *torch_own[1]],
                               [ref[0][0], *ref[1]]):
        assert got.dtype == dtype
        err = (got.double() - want).abs().max().item()
        base_err = (base.double() - want).abs().max().item()
        step = torch.finfo(dtype).eps * want.abs().max().item()
        assert err <= 2 * base_err + step, (err, base_err, step)


@pytest.mark.parametrize("backend", ["reference", "cpu_flash"])
def test_a_loss_on_the_lse_alone_has_exact_gradients(backend):
    """d lse / d v = 0, and the output's gradient is absent (not zero-filled by the caller)."""
    q, k, v = leaves(1, 20, 4, 2, 16)
    g_lse = torch.randn(1, 4, 20, dtype=torch.float64)
    lse = attention_with_lse(q, k, v, backend=backend)[1]
    dq, dk, dv = torch.autograd.grad((lse * g_lse).sum(), (q, k, v))
    ref_lse = sdpa_oracle(q, k, v, True, None, 0.25)[1]
    ref_dq, ref_dk = torch.autograd.grad((ref_lse * g_lse).sum(), (q, k))
    torch.testing.assert_close(dq, ref_dq, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(dk, ref_dk, rtol=1e-8, atol=1e-8)
    assert dv.shape == v.shape and not dv.any()


def test_gradients_reach_only_inputs_that_need_them():
    q, k, v = leaves(1, 12, 2, 2, 8)
    k = k.detach()
    out = attention(q, k, v, backend="reference")
    out.sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


BAD = [
    (dict(q=(2, 8, 4, 16)), "4-D", dict(q=(8, 4, 16))),
    (dict(), "same shape", dict(v=(1, 8, 2, 8))),
    (dict(), "batch and sequence", dict(k=(1, 9, 2, 16), v=(1, 9, 2, 16))),
    (dict(), "head_dim", dict(k=(1, 8, 2, 8), v=(1, 8, 2, 8))),
    (dict(), "multiple of the number of key/value heads", dict(k=(1, 8, 3, 16), v=(1, 8, 3, 16))),
]


@pytest.mark.parametrize("_, words, shapes", BAD)
def test_bad_shapes_get_one_clear_sentence(_, words, shapes):
    dims = {"q": (1, 8, 4, 16), "k": (1, 8, 2, 16), "v": (1, 8, 2, 16), **shapes}
    tensors = [torch.randn(*dims[n]) for n in "qkv"]
    with pytest.raises(ValueError, match=words):
        attention(*tensors)


@pytest.mark.parametrize("cu, words", [
    ([1, 8], "start at 0"),
    ([0, 5], "end at the sequence length 8"),
    ([0, 5, 3, 8], "strictly increasing"),
    (torch.tensor([0.0, 8.0]), "integer"),
])
def test_bad_cu_seqlens_are_rejected(cu, words):
    q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=words):
        attention(q, k, v, cu_seqlens=cu)


def test_bad_dtypes_scale_and_backends_are_rejected():
    q, k, v = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="share one float dtype"):
        attention(q, k.double(), v)
    with pytest.raises(ValueError, match="share one float dtype"):
        attention(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="softmax_scale"):
        attention(q, k, v, softmax_scale=0.0)
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'nope'"):
        attention(q, k, v, backend="nope")
    with pytest.raises(BackendUnavailable, match="cpu_flash backend cannot run this partial"):
        attention(q, k, v, cu_seqlens=[0, 3, 8], backend="cpu_flash")
