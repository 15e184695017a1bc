"""Schedules and layouts without any process group: exact coverage, matching messages, balance,
and the torch-free vocabulary that names them."""
from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from fractions import Fraction

import pytest
import torch

from lctrain_kernels.distributed import (
    global_order, layout_positions, local_spans, make_schedule, shard, shard_indices,
)
from lctrain_kernels.distributed.executor import Geometry, block_calls, pruned_plan
from lctrain_kernels.distributed.schedule import DIRECTIONS
from lctrain_kernels.masks import dense_mask
from lctrain_kernels.vocabulary import SCHEDULES, check_seq_len, schedule_layout, seq_chunks

KINDS = ("distflash", "ring", "zigzag")


def _visible(i: int, j: int, causal: bool, bounds) -> bool:
    if causal and j > i:
        return False
    if bounds is None:
        return True
    doc = lambda p: max(d for d, b in enumerate(bounds[:-1]) if b <= p)  # noqa: E731
    return doc(i) == doc(j)


def _pairs_of_block(blk, n: int, p: int, layout: str) -> list[tuple[int, int]]:
    qpos = shard_indices(n * p, p, blk.q_owner, layout).tolist()
    kpos = shard_indices(n * p, p, blk.kv_owner, layout).tolist()
    (a, b), (c, d) = blk.q_rows.resolve(n), blk.kv_rows.resolve(n)
    return [(qpos[i], kpos[j]) for i in range(a, b) for j in range(c, d)]


def _random_bounds(rng: random.Random, seq_len: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, seq_len), rng.randint(1, min(5, seq_len - 1))))
    return (0, *cuts, seq_len)


@pytest.mark.parametrize("kind", KINDS)
def test_every_visible_pair_is_computed_exactly_once(kind):
    for p in range(1, 9):
        sched = make_schedule(p, kind)
        for causal in (True, False):
            for n in ((4, 6) if sched.layout == "zigzag" else (5, 6)):
                plan = sched.plan("forward", causal)
                count = Counter(pr for s in plan.steps for b in s.blocks
                                for pr in _pairs_of_block(b, n, p, sched.layout))
                want = {(i, j) for i in range(n * p) for j in range(n * p) if _visible(i, j, causal, None)}
                seen = {pr for pr, c in count.items() if _visible(*pr, causal, None)}
                assert seen == want, (kind, p, causal, n)
                assert all(count[pr] == 1 for pr in want), (kind, p, causal, n)


def test_distflash_diagonal_cuts_still_cover_every_pair_once():
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    n = 8
    for p in range(2, 7):
        cuts = tuple(Fraction(rng.randint(1, n - 1), n) for _ in range(p))
        plan = make_schedule(p).plan("forward", True, Fraction(rng.randint(1, n - 1), n), cuts)
        plan.validate()
        count = Counter(pr for s in plan.steps for b in s.blocks
                        for pr in _pairs_of_block(b, n, p, "contiguous"))
        want = {(i, j) for i in range(n * p) for j in range(i + 1)}
        assert {pr for pr in count if _visible(*pr, True, None)} == want
        assert all(count[pr] == 1 for pr in want), (p, cuts)
        first, last = plan.steps[0].blocks, plan.steps[-1].blocks
        assert [b.kv_rows.stop for b in first] == [b.q_rows.start for b in last] == list(cuts)
    with pytest.raises(ValueError, match="one value per rank"):
        make_schedule(2).plan(cuts=(Fraction(1, 2),))
    with pytest.raises(ValueError, match="a cut must lie strictly between 0 and 1"):
        make_schedule(2).plan(cuts=(Fraction(1, 2), Fraction(1)))


@pytest.mark.parametrize("kind", KINDS)
def test_inputs_are_available_where_blocks_run(kind):
    for p in range(1, 9):
        for causal in (True, False):
            for direction in ("forward", "backward"):
                plan = make_schedule(p, kind).plan(direction, causal)
                plan.validate()
                for b in (blk for s in plan.steps for blk in s.blocks):  # compute where data lives
                    assert b.rank in (b.q_owner, b.kv_owner)


def test_distflash_steps_are_shift_permutations_with_one_block_per_rank():
    for p in range(2, 9):
        plan = make_schedule(p).plan("backward")
        for k, step in enumerate(plan.steps):
            for msgs in (step.inputs, step.outputs):
                assert len({m.src for m in msgs}) == len(msgs) == len({m.dst for m in msgs})
                assert len({(m.dst - m.src) % p for m in step.inputs}) <= 1
            if 0 < k < len(plan.steps) - 1:  # every rank busy at every middle step
                assert sorted({b.rank for b in step.blocks}) == list(range(p))
        kinds = Counter(m.kind for s in plan.steps for m in s.outputs)
        assert kinds["dq"] + kinds["dkv"] > 0


def test_balance_figures():
    for p in range(1, 65):
        work = make_schedule(p).work_per_rank()
        assert max(work) / (sum(work) / p) == pytest.approx(1.0, abs=1e-12), p
        assert sum(work) == pytest.approx(p * p / 2)
        if p <= 16:
            assert make_schedule(p, "zigzag").balance() == pytest.approx(1.0)
    assert make_schedule(4, "ring").work_per_rank() == [0.5, 1.5, 2.5, 3.5]
    assert make_schedule(2, "ring").balance() == pytest.approx(1.5)
    assert make_schedule(4, "distflash").balance(causal=False) == pytest.approx(1.0)


def test_block_calls_and_pruning_cover_documents_exactly():
    rng = random.Random(7)
    for _ in range(60):
        p, kind = rng.randint(1, 6), rng.choice(KINDS)
        layout = make_schedule(p, kind).layout
        n, causal = rng.choice((4, 6, 8)), rng.random() < 0.7
        bounds = _random_bounds(rng, n * p) if rng.random() < 0.8 else None
        geo = Geometry(n * p, p, layout, causal, bounds)
        plan = pruned_plan(kind, "forward", geo)
        plan.validate()
        count = Counter()
        for blk in (b for s in plan.steps for b in s.blocks):
            calls = block_calls(blk, geo)
            assert calls, "pruned plans keep only blocks with something visible"
            qpos = shard_indices(n * p, p, blk.q_owner, layout)[slice(*blk.q_rows.resolve(n))]
            kpos = shard_indices(n * p, p, blk.kv_owner, layout)[slice(*blk.kv_rows.resolve(n))]
            for c in calls:
                qs, ks = qpos[c.qa:c.qb].tolist(), kpos[c.ka:c.kb].tolist()
                assert qs == list(range(qs[0], qs[0] + len(qs))) or not c.spec.causal
                mask = dense_mask(c.spec, len(qs), len(ks))
                for i, qi in enumerate(qs):
                    for j, kj in enumerate(ks):
                        if mask is None or mask[i, j]:
                            assert _visible(qi, kj, causal, bounds), (kind, p, bounds, c)
                            count[(qi, kj)] += 1
        want = [(i, j) for i in range(n * p) for j in range(n * p) if _visible(i, j, causal, bounds)]
        assert sorted(count) == want and set(count.values()) == {1}, (kind, p, bounds)


def test_pruning_drops_whole_blocks_and_their_messages():
    geo = Geometry(32, 4, "contiguous", True, (0, 3, 8, 20, 32))  # chunks of 8 tokens
    full = make_schedule(4).plan("forward")
    plan = pruned_plan("distflash", "forward", geo)
    blocks = [b for s in plan.steps for b in s.blocks]
    assert not any(b.q_owner == 3 and b.kv_owner in (0, 1) for b in blocks)  # doc [20, 32)
    assert not any(b.q_owner == 2 and b.kv_owner == 0 for b in blocks)
    n_msgs = lambda pl: sum(len(s.inputs) + len(s.outputs) for s in pl.steps)  # noqa: E731
    assert n_msgs(plan) < n_msgs(full)


def test_trimming_sends_only_the_rows_that_see_something():
    # rank 1 holds [16, 32): its rows 16..19 see rank 0's keys 12..15 (document [12, 20))
    geo = Geometry(32, 2, "contiguous", True, (0, 12, 20, 32))
    for direction in DIRECTIONS:
        plan = pruned_plan("distflash", direction, geo)
        plan.validate()
        msgs = [m for s in plan.steps for m in s.inputs + s.outputs]
        kv = [m.rows.resolve(16) for m in msgs if m.kind in ("kv", "dkv")]
        q = [m.rows.resolve(16) for m in msgs if m.kind in ("q", "out", "dq")]
        assert kv and all(rows == (12, 16) for rows in kv), kv
        assert all(0 <= a < b <= 4 for a, b in q), q
    rng = random.Random(11)  # random documents: a travelling block's first and last rows and
    for _ in range(40):       # keys each see something (the hulls are tight)
        p = rng.randint(2, 6)
        n = rng.choice((4, 6, 8))
        bounds = _random_bounds(rng, n * p)
        plan = pruned_plan("distflash", "backward", Geometry(n * p, p, "contiguous", True, bounds))
        plan.validate()
        for b in (b for s in plan.steps for b in s.blocks if b.rank != b.q_owner or b.rank != b.kv_owner):
            (qa, qb), (ka, kb) = b.q_rows.resolve(n), b.kv_rows.resolve(n)
            qs, ks = range(b.q_owner * n + qa, b.q_owner * n + qb), range(b.kv_owner * n + ka, b.kv_owner * n + kb)
            for i in (qs[0], qs[-1]):
                assert any(_visible(i, j, True, bounds) for j in ks), (bounds, b)
            for j in (ks[0], ks[-1]):
                assert any(_visible(i, j, True, bounds) for i in qs), (bounds, b)


def test_layout_maps_and_errors():
    for p in range(1, 7):
        for layout in ("contiguous", "zigzag"):
            n = 4 * p
            order = global_order(n, p, layout)
            assert sorted(order.tolist()) == list(range(n))
            spans = [layout_positions(n, p, r, layout) for r in range(p)]
            assert sum(b - a for sp in spans for a, b in sp) == n
            x = torch.randn(2, n, 3)
            parts = [shard(x, layout=layout, dim=1, rank=r, world_size=p) for r in range(p)]
            assert torch.equal(torch.cat(parts, 1)[:, torch.argsort(order)], x)
            assert local_spans(n, p, p - 1, layout, 0, 4)[0][1] == spans[-1][0][0]
    assert layout_positions(8, 2, 1, "zigzag") == [(2, 4), (4, 6)]
    with pytest.raises(ValueError, match="not divisible by 4"):
        layout_positions(6, 2, 0, "zigzag")
    with pytest.raises(ValueError, match="unknown layout"):
        shard(torch.zeros(4), layout="striped", dim=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule(2, "tree")
    with pytest.raises(ValueError, match="positive integer"):
        make_schedule(0)


def test_vocabulary_names_every_schedule_and_its_layout():
    assert sorted(SCHEDULES) == sorted(KINDS)
    for kind, layout in zip(KINDS, ("contiguous", "contiguous", "zigzag")):
        assert schedule_layout(kind) == layout
        for p in (1, 3):
            sched = make_schedule(p, kind)
            assert sched.layout == layout == sched.plan("backward", False).layout
            assert seq_chunks(p, layout) == p * (2 if layout == "zigzag" else 1)
    with pytest.raises(ValueError, match="unknown schedule 'tree'; choose one of distflash"):
        schedule_layout("tree")
    with pytest.raises(ValueError, match="unknown layout 'striped'"):
        seq_chunks(2, "striped")


def test_seq_len_rule_says_which_lengths_work():
    assert check_seq_len(36, 3, "zigzag") == 6 and check_seq_len(7, 1, "contiguous") == 7
    with pytest.raises(ValueError, match=r"^sequence length 26 is not divisible by 12 \(2 × world "
                                         r"size 6 for the zigzag layout\); use a multiple of 12 "
                                         r"such as 24 or 36$"):
        check_seq_len(26, 6, "zigzag")
    with pytest.raises(ValueError, match=r"^data.seq_len 3 is not divisible by 4 \(parallel.cp "
                                         r"for the contiguous layout\); use a multiple of 4 such "
                                         r"as 4$"):
        check_seq_len(3, 4, "contiguous", what="data.seq_len", ranks="parallel.cp")
    with pytest.raises(ValueError, match="world size must be a positive integer"):
        check_seq_len(4, 0, "contiguous")


def test_vocabulary_and_config_load_without_torch():
    """The recipe schema and the CLI read the vocabulary; neither may pull torch in."""
    code = ("import sys, lctrain_kernels, lctrain_kernels.vocabulary, lctrain.config, "
            "lctrain.cli.options; print(sorted({'torch', 'triton'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_accumulators_copy_merge_and_fill_untouched_rows():
    from lctrain_kernels.combine import GradAcc, OutAcc

    n, parts = 10, [(0, 4), (2, 7), (0, 4)]  # overlapping runs; rows 7..9 never reached
    outs = [torch.randn(2, b - a, 3, 5) for a, b in parts]
    lses = [torch.randn(2, 3, b - a) for a, b in parts]
    acc, grads = OutAcc(n), GradAcc(n)
    for (a, b), o, l in zip(parts, outs, lses):
        acc.add(a, b, o, l)
        grads.add(a, b, o)
    out, lse = acc.result(torch.empty(2, n, 3, 5, dtype=torch.float64))
    w_lse = torch.full((2, 3, n), float("-inf"), dtype=torch.float64)
    w_num = torch.zeros(2, n, 3, 5, dtype=torch.float64)
    w_sum = torch.zeros(2, n, 3, 5, dtype=torch.float64)
    for (a, b), o, l in zip(parts, outs, lses):
        w_lse[:, :, a:b] = torch.logaddexp(w_lse[:, :, a:b], l.double())
        w_num[:, a:b] += o.double() * l.double().exp().transpose(1, 2)[..., None]
        w_sum[:, a:b] += o.double()
    want = w_num / w_lse.exp().transpose(1, 2)[..., None]
    assert out.dtype == torch.float64 and torch.allclose(out[:, :7], want[:, :7], atol=1e-5)
    assert torch.allclose(lse.double(), w_lse, atol=1e-5) and (out[:, 7:] == 0).all()
    assert torch.allclose(grads.result(w_sum), w_sum, atol=1e-5)
    single = OutAcc(4)
    o, l = torch.randn(1, 4, 2, 3), torch.randn(1, 2, 4)
    single.add(0, 4, o, l)
    assert single.result(o)[0] is o  # one result covering every row is kept as it is


def test_accumulators_fold_into_float32_when_results_pile_up():
    from lctrain_kernels.combine import GradAcc, OutAcc

    n, b, h, d = 8, 1, 2, 4
    parts = [(0, 8), (0, 8), (4, 8), (0, 8), (2, 6), (0, 8), (0, 4)]  # more than the budget holds
    outs = [torch.randn(b, hi - lo, h, d) for lo, hi in parts]
    lses = [torch.randn(b, h, hi - lo) for lo, hi in parts]
    acc, grads = OutAcc(n), GradAcc(n)
    budget = 2 * 4 * b * n * h * d  # float32 accumulator + one float32 result of n rows
    for (lo, hi), o, l in zip(parts, outs, lses):
        acc.add(lo, hi, o, l)
        grads.add(lo, hi, o)
        held = sum(t.numel() * 4 for _, _, ts in grads.parts for t in ts)
        held += 0 if grads.base is None else grads.base[0].numel() * 4
        assert held <= budget
    assert grads.base is not None and acc.base is not None  # the budget forced a fold
    want_sum = torch.zeros(b, n, h, d, dtype=torch.float64)
    want_lse = torch.full((b, h, n), float("-inf"), dtype=torch.float64)
    num = torch.zeros(b, n, h, d, dtype=torch.float64)
    for (lo, hi), o, l in zip(parts, outs, lses):
        want_sum[:, lo:hi] += o.double()
        want_lse[:, :, lo:hi] = torch.logaddexp(want_lse[:, :, lo:hi], l.double())
        num[:, lo:hi] += o.double() * l.double().exp().transpose(1, 2)[..., None]
    out, lse = acc.result(outs[0])
    torch.testing.assert_close(grads.result(outs[0]).double(), want_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), num / want_lse.exp().transpose(1, 2)[..., None],
                               rtol=1e-5, atol=1e-5)
