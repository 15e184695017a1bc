"""The flash_attn_cute backend's block logic on a CPU: FlashAttention 4's varlen kernels are
replaced by float64 math of their contract (entry b starts at row cu_seqlens[b] and is
seqused[b] rows long; causal from the bottom-right corner; a right window; head-major lse;
outputs written in place, other rows untouched), so the launches, offsets and statistics
layout of :class:`CuteEngine` are checked against the float64 oracle of whole blocks. The real
kernels are checked on a GPU (tests/test_kernels_ragged.py, tests/test_bench_gpu.py)."""
import random

import pytest
import torch

from mask_cases import SHAPES, bounds_of, random_block
from lctrain_kernels.backends import BackendUnavailable, get_backend
from lctrain_kernels.backends.flash_attn_cute import CuteEngine, launches
from lctrain_kernels.masks import MaskSpec, Relation, classify
from lctrain_kernels.ragged import plan_ragged
from test_kernels_ragged import check


def _entries(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    for b in range(len(seqused_q)):
        yield (int(cu_seqlens_q[b]), int(cu_seqlens_k[b]), int(seqused_q[b]),
               int(seqused_k[b]))


def _visible(nq, nk, causal, window_size_left, window_size_right):
    """FlashAttention's mask: query i sees key j if j <= i + nk - nq (+ right window)."""
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None]
    assert window_size_left is None
    if causal:
        return j <= i + nk - nq
    if window_size_right is not None:
        return j <= i + nk - nq + window_size_right
    return torch.ones(nq, nk, dtype=torch.bool)


def _scores(q, k, scale, mask):
    """(H, nq, nk) masked scores of one entry; K heads repeated for GQA."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (torch.einsum("qhd,khd->hqk", q, k) * scale).masked_fill(~mask, float("-inf"))


def _group_sum(x, hkv):
    """(n, Hq, D) gradients summed over each GQA group -> (n, Hkv, D)."""
    return x.view(x.shape[0], hkv, -1, x.shape[2]).sum(2)


def fa_forward(q, k, v, *, softmax_scale, out, lse, return_lse, max_seqlen_q, max_seqlen_k,
               causal, window_size_left=None, window_size_right=None, **cols):
    assert return_lse and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous()
    assert out.shape == q.shape and q.dim() == 3
    for rq, rk, nq, nk in _entries(**cols):
        assert nq <= max_seqlen_q and nk <= max_seqlen_k
        mask = _visible(nq, nk, causal, window_size_left, window_size_right)
        s = _scores(q[rq:rq + nq], k[rk:rk + nk], softmax_scale, mask)
        lse_b = torch.logsumexp(s, -1)
        p = torch.exp(s - lse_b[..., None]).nan_to_num(0.0)
        vv = v[rk:rk + nk].repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out[rq:rq + nq] = torch.einsum("hqk,khd->qhd", p, vv)
        lse[:, rq:rq + nq] = lse_b


def fa_backward(q, k, v, out, dout, lse, *, softmax_scale, dq, dk, dv, max_seqlen_q,
                max_seqlen_k, causal, window_size_left=None, window_size_right=None, **cols):
    hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    for rq, rk, nq, nk in _entries(**cols):
        mask = _visible(nq, nk, causal, window_size_left, window_size_right)
        qs, ks, vs = q[rq:rq + nq], k[rk:rk + nk], v[rk:rk + nk]
        do, o = dout[rq:rq + nq], out[rq:rq + nq]
        s = _scores(qs, ks, softmax_scale, mask)  # probabilities from the lse handed in
        p = torch.exp(s - lse[:, rq:rq + nq, None]).nan_to_num(0.0)
        dp = torch.einsum("qhd,khd->hqk", do, vs.repeat_interleave(g, dim=1))
        delta = (do * o).sum(-1).t()[..., None]  # (H, nq, 1)
        ds = p * (dp - delta) * softmax_scale
        dq[rq:rq + nq] = torch.einsum("hqk,khd->qhd", ds, ks.repeat_interleave(g, dim=1))
        dk[rk:rk + nk] = _group_sum(torch.einsum("hqk,qhd->khd", ds, qs), hkv)
        dv[rk:rk + nk] = _group_sum(torch.einsum("hqk,qhd->khd", p, do), hkv)


ENGINE = CuteEngine(fa_forward, fa_backward)


def test_taller_causal_pieces_run_as_a_right_window():
    """A diagonal block cut by key rows: the last document's piece has more query rows than
    keys, and runs apart from the square pieces with the window that makes it top-left."""
    spec = MaskSpec(True, 0, 0, bounds_of(10, 20, 34))
    (call,) = plan_ragged(spec, 64, 40).calls
    assert call.causal and call.q_lens == (10, 20, 34) and call.k_lens == (10, 20, 10)
    square, tall = launches(call)
    assert (square.causal, square.right, square.q_rows, square.q_lens) == \
        (True, None, (0, 10), (10, 20))
    assert (tall.causal, tall.right, tall.q_rows, tall.k_rows, tall.q_lens, tall.k_lens) == \
        (False, 24, (30,), (30,), (34,), (10,))
    check(spec, 64, 40, engine=ENGINE)


@pytest.mark.parametrize("name", list(SHAPES))
def test_block_logic_matches_float64_reference_on_every_mask_shape(name, poisoned):
    spec, sq, sk = SHAPES[name]
    for hkv, batch in ((2, 2), (4, 1), (1, 1)):  # GQA, MHA, MQA; batched and not
        check(spec, sq, sk, engine=ENGINE, hkv=hkv, batch=batch)


def test_block_logic_on_random_blocks(poisoned):
    rng = random.Random()
    for _ in range(40):
        spec, sq, sk = random_block(rng)
        if classify(spec, sq, sk) is Relation.EMPTY:  # never handed to a backend
            continue
        check(spec, sq, sk, engine=ENGINE, lse_grad=rng.random() < 0.5)


def test_without_flash_attention_4_the_backend_says_how_to_install_it():
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match=r"pip install 'lctrain\[fa4\]'"):
            get_backend("flash_attn_cute")
    else:
        pytest.skip("FlashAttention 4 is installed here")
