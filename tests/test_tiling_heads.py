"""Attention in head groups: the same outputs, lse and gradients as one group and as float64
math, locally and over gloo ranks, and a workspace that shrinks with the number of groups."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from lctrain_kernels import attention_with_lse, dist_attention_with_lse
from lctrain_kernels.distributed import make_schedule, shard
from lctrain_kernels.distributed import op
from lctrain_kernels.distributed.executor import backward_in_groups, forward_in_groups, head_slices
from live_bytes import LiveBytes
from spawn import run_on_ranks

D = 8


def _inputs(gen, bsz, n, hq, hkv):
    full = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return (full(bsz, n, hq, D), full(bsz, n, hkv, D), full(bsz, n, hkv, D),
            full(bsz, n, hq, D), full(bsz, hq, n))


def _run(fn, q, k, v, g, gl, **kwargs):
    """out, lse, dq, dk, dv of ``fn`` with a loss on both the output and the lse."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, **kwargs)
    ((out * g).sum() + (lse * gl).sum()).backward()
    return [out.detach(), lse.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("hq, hkv, groups, bounds", [(4, 2, 2, None), (6, 6, 3, (0, 7, 20, 31))])
def test_local_head_groups_match_float64_reference(hq, hkv, groups, bounds):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    q, k, v, g, gl = _inputs(gen, 2, 31, hq, hkv)
    ref = _run(attention_with_lse, q, k, v, g, gl, cu_seqlens=bounds, backend="reference")
    for backend in ("reference", "auto"):
        got = _run(attention_with_lse, q, k, v, g, gl, cu_seqlens=bounds, backend=backend,
                   head_groups=groups)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_head_groups_are_checked():
    q, k, v = torch.randn(1, 8, 4, D), torch.randn(1, 8, 2, D), torch.randn(1, 8, 2, D)
    for bad in (0, 3, 4, 1.5, True):
        with pytest.raises(ValueError, match="positive divisor of the 2 key/value heads"):
            attention_with_lse(q, k, v, head_groups=bad)
    assert head_slices(2, 4, 2) == [(slice(0, 2), slice(0, 1)), (slice(2, 4), slice(1, 2))]


def _distributed(rank: int, world: int, seed: int) -> dict:
    group = dist.group.WORLD
    errors, workspace = {}, {}
    cases = [("distflash", 4, 2, 2, None), ("zigzag", 4, 4, 4, (0, 5, 19, 24)),
             ("ring", 8, 2, 2, (0, 12, 24))]
    for i, (schedule, hq, hkv, groups, bounds) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + i)
        q, k, v, g, gl = _inputs(gen, 1, 24, hq, hkv)
        ref = _run(attention_with_lse, q, k, v, g, gl, cu_seqlens=bounds, backend="reference")
        layout = make_schedule(world, schedule).layout
        cut = lambda t, dim=1: shard(t, group, layout, dim=dim)  # noqa: E731
        loc = [cut(t) for t in (q, k, v, g)] + [cut(gl, 2)]
        got = _run(dist_attention_with_lse, *loc, group=group, cu_seqlens=bounds,
                   schedule=schedule, backend="reference", head_groups=groups)
        want = [cut(ref[0]), cut(ref[1], 2), *(cut(t) for t in ref[2:])]
        errors[schedule] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
    q, k, v, g, gl = _inputs(torch.Generator().manual_seed(seed), 1, 256, 8, 8)
    options = dict(group_name=group.group_name, causal=True, doc_bounds=[],
                   softmax_scale=D ** -0.5, schedule="distflash", backend="reference",
                   overlap=True)  # the op's own walks, inside the mode (the op hides them)
    forward = functools.partial(op.forward_group, **options)
    backward = functools.partial(op.backward_group, **options)
    for groups in (1, 4):  # the buffers of one walk: received k/v, accumulators, gradients
        with LiveBytes() as live:
            out, lse = forward_in_groups(forward, q, k, v, groups)
            fwd = live.peak - live.live  # transients beyond the results
            live.reset_peak()
            backward_in_groups(backward, g, q, k, v, out, lse, gl, groups)
            workspace[groups] = (fwd, live.peak - 3 * q.numel() * q.element_size())
    return {"errors": errors, "workspace": workspace}


def test_distributed_head_groups_match_float64_reference_and_need_less():
    seed = int(torch.randint(0, 1 << 30, ()))
    for result in run_on_ranks(_distributed, 2, seed):
        assert all(err < 1e-10 for err in result["errors"].values()), result["errors"]
        (fwd1, bwd1), (fwd4, bwd4) = result["workspace"][1], result["workspace"][4]
        assert fwd4 < 0.45 * fwd1 and bwd4 < 0.5 * bwd1, result["workspace"]
