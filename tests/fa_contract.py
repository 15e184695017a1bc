"""FlashAttention 4's varlen kernels as float64 math of their contract, for CPU tests of the
flash_attn_cute backend's block logic: entry b starts at row cu_seqlens[b] and is seqused[b] rows
long; causal masks are aligned to the bottom-right corner, a right window bounds them further;
the lse is head-major (Hq, T); outputs and gradients are written in place, other rows untouched.
Signatures follow ``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` as the
backend calls them."""
import torch


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
