"""dist_attention over gloo against the single-process reference: outputs, lse, all gradients.

Each spawn runs many cases (process start-up dominates on 2 CPU cores). Every rank draws the
same full-sequence inputs, computes the reference on the whole sequence, shards, runs the
distributed op and reports the largest relative error per case; the parent asserts.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from lctrain_kernels import attention_with_lse, dist_attention, dist_attention_with_lse
from lctrain_kernels.distributed import make_schedule, shard, unshard
from lctrain_kernels.distributed.balance import balanced_cuts, balanced_split
from lctrain_kernels.distributed.executor import Geometry, pruned_plan
from lctrain_kernels.masks import MaskSpec
from lctrain_kernels.reference import reference_forward
from spawn import run_on_ranks

TOL = 1e-4  # float32 everywhere; the reference backend computes in float32
D = 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _one_case(group, case: dict) -> float:
    """Max relative error of out, lse, dq, dk, dv for one case on this rank."""
    world = dist.get_world_size(group)
    gen = torch.Generator().manual_seed(case["seed"])
    bsz, n, hq, hkv = case["batch"], case["n"], case["hq"], case["hkv"]
    full = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = full(bsz, n * world, hq, D), full(bsz, n * world, hkv, D), full(bsz, n * world, hkv, D)
    g, gl = full(bsz, n * world, hq, D), full(bsz, hq, n * world)
    use_lse = case.get("lse_grad", False)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = attention_with_lse(*ref, causal=case["causal"], cu_seqlens=case["bounds"], backend="reference")
    ((o * g).sum() + ((lse * gl).sum() if use_lse else 0)).backward()

    layout = make_schedule(world, case["schedule"]).layout
    loc = [shard(t, group, layout).requires_grad_() for t in (q, k, v)]
    o_l, lse_l = dist_attention_with_lse(*loc, group=group, causal=case["causal"], cu_seqlens=case["bounds"],
                                         schedule=case["schedule"], backend=case["backend"], overlap=case["overlap"])
    if case.get("unshard"):  # every rank's loss is the whole one: divide by the ranks
        loss = (unshard(o_l, group, layout) * g).sum() / world
    else:
        loss = (o_l * shard(g, group, layout)).sum()
    (loss + ((lse_l * shard(gl, group, layout, dim=2)).sum() if use_lse else 0)).backward()
    pairs = [(o_l, shard(o, group, layout)), (lse_l, shard(lse, group, layout, dim=2))]
    pairs += [(a.grad, shard(b.grad, group, layout)) for a, b in zip(loc, ref)]
    return max(_rel(a.detach(), b.detach()) for a, b in pairs)


def _phase(group, cases: list[dict]) -> dict:
    errors = {c["name"]: _one_case(group, c) for c in cases}
    checks = {}
    p = dist.get_world_size(group)
    for layout in ("contiguous", "zigzag"):  # shard/unshard round trip
        x = torch.randn(2, 4 * p, 3, generator=torch.Generator().manual_seed(5))
        checks[layout] = torch.equal(unshard(shard(x, group, layout), group, layout), x)
    try:  # a local length the zigzag layout cannot split
        x = torch.randn(1, 3, 2, D)
        dist_attention(x, x, x, group=group, schedule="zigzag")
    except ValueError as e:
        checks["zigzag_error"] = str(e)
    return {"errors": errors, "checks": checks, "world": p}


def _worker(rank: int, world: int, phases: list[tuple[list[int] | None, list[dict]]]) -> list[dict]:
    """Run each phase's cases on the whole world (None) or on a sub-group of its ranks."""
    results = []
    for sub_ranks, cases in phases:
        group = dist.group.WORLD if sub_ranks is None else dist.new_group(sub_ranks)
        if sub_ranks is None or rank in sub_ranks:
            results.append(_phase(group, cases))
    return results


def _cases(world: int, schedules=("distflash", "ring", "zigzag"), docs=(), lse_every=5) -> list[dict]:
    """Every schedule × causal × overlap, then document masks; GQA, batch, the backend ("auto":
    cpu_flash for full and causal blocks, whose lse gradient takes a second backward) and a
    loss on the lse vary by case."""
    cases = []
    combos = itertools.product(schedules, (True, False), (True, False), [None, *docs])
    for i, (sched, causal, overlap, bounds) in enumerate(combos):
        if bounds is not None and not overlap:
            continue
        n = 6 if sched == "zigzag" or i % 3 else 5  # odd local lengths where the layout allows
        cases.append(dict(name=f"{sched}/causal={causal}/overlap={overlap}/{getattr(bounds, '__name__', 'nodocs')}/{i}", seed=i,
                          schedule=sched, causal=causal, overlap=overlap, n=n, batch=1 + i % 2,
                          hq=4, hkv=(4, 2, 1)[i % 3], bounds=None if bounds is None else bounds(n * world),
                          lse_grad=i % lse_every == 0, unshard=i % 4 == 1,
                          backend="auto" if i % 3 == 2 or i % lse_every == 0 else "reference"))
    return cases


def _check(results: list[list[dict]], phases) -> None:
    for sub_ranks, cases in phases:
        world = len(results) if sub_ranks is None else len(sub_ranks)
        got = [next(r for r in per_rank if r["world"] == world) for per_rank in results
               if any(r["world"] == world for r in per_rank)]
        assert len(got) == world
        for r in got:
            bad = {name: err for name, err in r["errors"].items() if not err < TOL}
            assert not bad, bad
            assert r["errors"].keys() == {c["name"] for c in cases}
            assert r["checks"]["contiguous"] and r["checks"]["zigzag"]
            assert "not divisible by" in r["checks"]["zigzag_error"]


def _docs_inside(n_total: int):  # a boundary inside a chunk, and a one-token document
    return (0, 1, n_total // 2 + 1, n_total)


def _docs_blocks(n_total: int):  # documents that leave whole blocks empty
    q = n_total // 4
    return (0, q - 1, q + 2, 3 * q, n_total)


def _docs_uneven(n_total: int):  # distflash's split and cuts off the half, k/v sent in part
    bounds = (0, n_total // 3, n_total)
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    split = balanced_split(lengths, n_total, 2)
    assert split != 0.5 and balanced_cuts(lengths, n_total, 2, "distflash", split) != (0.5, 0.5)
    plan = pruned_plan("distflash", "backward", Geometry(n_total, 2, "contiguous", True, bounds))
    kv = [m.rows.resolve(n_total // 2) for s in plan.steps for m in s.inputs if m.kind == "kv"]
    assert kv == [(n_total // 3, n_total // 2)], kv  # rank 0's keys from the second document on
    return bounds


def test_two_ranks_every_schedule_and_mask():
    phases = [(None, _cases(2, docs=(_docs_inside, _docs_blocks, _docs_uneven)))]
    _check(run_on_ranks(_worker, 2, phases), phases)


def test_three_ranks_odd_world():
    phases = [(None, [c for c in _cases(3, docs=(_docs_blocks,), lse_every=4)
                      if c["overlap"] or c["schedule"] == "distflash"])]
    _check(run_on_ranks(_worker, 3, phases), phases)


def test_six_ranks_and_sub_groups_of_five_and_four():
    """World sizes 6, 5 (ranks 1..5: group ranks differ from global ranks) and 4."""
    pick = lambda cases: [c for c in cases if c["causal"] and c["overlap"]]  # noqa: E731
    phases = [(None, pick(_cases(6, docs=(_docs_blocks,)))),
              ([1, 2, 3, 4, 5], pick(_cases(5, ("distflash", "ring"), docs=(_docs_inside,)))),
              ([0, 2, 3, 5], pick(_cases(4, ("distflash", "zigzag"), docs=(_docs_blocks,))))]
    _check(run_on_ranks(_worker, 6, phases), phases)


def test_single_rank_runs_local_attention_and_validates():
    q, k, v = torch.randn(2, 10, 4, D), torch.randn(2, 10, 2, D), torch.randn(2, 10, 2, D)
    for causal, bounds in ((True, None), (False, None), (True, [0, 3, 10])):
        ref_out, ref_lse = reference_forward(q.double(), k.double(), v.double(),
                                             MaskSpec(causal, doc_bounds=bounds and tuple(bounds)), D ** -0.5)
        for schedule in ("distflash", "ring", "zigzag"):  # one rank: every plan is one block
            out, lse = dist_attention_with_lse(q, k, v, causal=causal, cu_seqlens=bounds, schedule=schedule)
            assert _rel(out, ref_out.float()) < TOL and _rel(lse, ref_lse.float()) < TOL
    with pytest.raises(ValueError, match="unknown schedule"):
        dist_attention(q, k, v, schedule="tree")
    with pytest.raises(ValueError, match="multiple of the number"):
        dist_attention(q, torch.randn(2, 10, 3, D), torch.randn(2, 10, 3, D))
    with pytest.raises(ValueError, match="end at the sequence length 10, got 8"):
        dist_attention(q, k, v, cu_seqlens=[0, 4, 8])
    with pytest.raises(ValueError, match="4-D"):
        dist_attention(q[0], k, v)
    out = torch.ops.lctrain.dist_attention(q, k, v, "", True, [], 0.25, "distflash", "reference", True)
    assert out[0].shape == q.shape and out[1].shape == (2, 4, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_custom_ops_pass_opcheck(dtype):
    """Schema, fake (meta) kernels (shapes and strides) and autograd registration hold, so
    torch.compile can trace; inputs are BSHD views of BHSD tensors, as a transformers model
    passes them; the lse is float64 for float64 inputs, in the real and the fake kernels alike."""
    q = torch.randn(1, 4, 8, D, dtype=dtype).transpose(1, 2).requires_grad_()  # (B, S, H, D)
    k, v = (torch.randn(1, 2, 8, D, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(2))
    opts = ("", True, [0, 3, 8], 0.25, "distflash", "reference", True)
    torch.library.opcheck(torch.ops.lctrain.dist_attention.default, (q, k, v, *opts))
    out, lse = torch.ops.lctrain.dist_attention(q, k, v, *opts)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    plain = [t.detach() for t in (torch.randn_like(out), q, k, v, out, lse)]
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(torch.ops.lctrain.dist_attention_backward.default,
                              (*plain, *opts, dlse))


@pytest.mark.parametrize("calls", [1, 2, 3])
def test_host_waits_for_the_gpu_calls_back(monkeypatch, calls):
    """bound_host_lead: after each attention call the host has waited for every call at least
    ``calls`` back on the GPU, and for none newer; off a GPU it records nothing."""
    from collections import deque

    from lctrain_kernels.distributed import comm

    waited, made = [], []

    class Event:
        def synchronize(self):
            waited.append(self)

    class Stream:
        def record_event(self):
            made.append(Event())
            return made[-1]

    monkeypatch.setattr(comm, "_ends", deque())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream())
    comm.bound_host_lead(torch.device("cpu"), calls)
    assert made == []
    for call in range(int(torch.randint(4, 9, ()))):
        comm.bound_host_lead(torch.device("cuda", 0), calls)
        assert waited == made[:max(0, call + 1 - calls)]
