"""docsplit's plans: exact pieces, shape ladders, and call plans that compute every visible pair
exactly once under any prices, with the GPU prices choosing as measured (pure host arithmetic)."""
import math
import random

import torch

from docsplit_cases import (GATHER, MODELS, PACK, PAD, SHAPES, bounds_of, lognormal_lengths,
                            random_block, random_model, tri, visible)
from lctrain_kernels.docsplit import (BATCH_STEPS, DenseCall, MaskedCall, batch_sizes,
                                      call_ranges, dense_rows, ladder_down, ladder_up, layout,
                                      pieces, split_block)
from lctrain_kernels.docsplit_cost import CPU_MODEL
from lctrain_kernels.pieces import causal_pairs
from lctrain_kernels.masks import MaskSpec


def test_pieces_cover_every_visible_pair_exactly_once():
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    cases = [random_block(rng) for _ in range(300)] + list(SHAPES.values())
    for spec, sq, sk in cases:
        got = torch.zeros(sq, sk, dtype=torch.int32)
        ps = pieces(spec, sq, sk)
        for p in ps:
            assert p.sq > 0 and p.sk > 0 and p.q0 + p.sq <= sq and p.k0 + p.sk <= sk
            got[p.q0:p.q0 + p.sq, p.k0:p.k0 + p.sk] += tri(p.sq, p.sk, p.causal)
        want = visible(spec, sq, sk)
        assert torch.equal(got, want.int()), (spec, sq, sk, ps)
        assert sum(p.pairs for p in ps) == int(want.sum())
        if spec.causal:  # only the document of the first query has a FULL part
            assert sum(not p.causal for p in ps) <= 1 and all(p.sk <= p.sq for p in ps if p.causal)


def test_causal_pairs_count_the_lower_triangle_in_any_window():
    for r0, r1, c0, c1 in ((a, b, c, d) for a in range(6) for b in range(8) for c in range(6)
                           for d in range(8)):
        want = sum(1 for t in range(r0, r1) for j in range(c0, c1) if j <= t)
        assert causal_pairs(r0, r1, c0, c1) == want, (r0, r1, c0, c1)


def check_plan(spec, sq, sk, plan, min_dense, steps):
    """Each visible pair computed exactly once by the plan's dense entries (real rows), masked
    calls (under the block's mask) and packed documents; shapes on the ladders; views inside
    the block; gathered and packed calls never share a row; free rows see nothing."""
    want = visible(spec, sq, sk)
    got = torch.zeros(sq, sk, dtype=torch.int32)
    for c in plan.dense:
        assert c.sq >= min_dense and c.sk >= min_dense and c.n in batch_sizes(c.n, BATCH_STEPS)
        assert c.sq == ladder_down(c.sq, steps) and c.sk == ladder_down(c.sk, steps)
        assert not c.padded or (c.causal and c.sq == c.sk)
        for i in range(c.n):
            if not c.gather:  # a view: the batch's rows lie inside the block
                assert c.q0[i] + c.sq <= sq and c.k0[i] + c.sk <= sk
            if c.n > 1 and not c.gather:  # adjacent and unpadded
                assert (c.q0[i], c.k0[i], c.rows[i]) == (c.q0[0] + i * c.sq,
                                                          c.k0[0] + i * c.sk, c.sq)
            rows, keys = c.rows[i], c.keys(i)
            got[c.q0[i]:c.q0[i] + rows, c.k0[i]:c.k0[i] + keys] += tri(rows, keys, c.causal)
    assert not (got.bool() & ~want).any(), (spec, sq, sk, plan)  # dense never unmasked
    for m in plan.masked:
        got[m.q0:m.q1, m.k0:m.k1] += want[m.q0:m.q1, m.k0:m.k1].int()
    if plan.packed is not None:
        for a, b, n in zip(plan.packed.q0, plan.packed.k0, plan.packed.n):
            got[a:a + n, b:b + n] += tri(n, n, spec.causal)
    assert torch.equal(got, want.int()), (spec, sq, sk, plan)
    assert plan.pairs == int(want.sum())
    lay, ranges = layout(plan, sq, sk), call_ranges(plan)
    alone = [i for i, c in enumerate(plan.dense) if c.gather]
    alone += [len(ranges) - 1] if plan.packed is not None else []
    assert not set(alone) & (lay.shared_q | lay.shared_k)
    for a, b in lay.free_q:
        assert not want[a:b].any()
    for a, b in lay.free_k:
        assert not want[:, a:b].any()
    for i in lay.shared_q:  # shares a row with another call
        assert any(a < d and c < b for a, b in ranges[i][0] for j, r in enumerate(ranges)
                   if j != i for c, d in r[0])


def test_plans_compute_every_visible_pair_once_under_any_prices():
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    cases = [random_block(rng) for _ in range(250)] + list(SHAPES.values()) * 6
    for spec, sq, sk in cases:
        model = random_model(rng) if rng.random() < 0.6 else rng.choice(list(MODELS.values()))
        min_dense, steps = rng.choice([1, 2, 4, 8]), rng.choice([0, 1, 2, 4, 8])
        force = rng.random() < 0.4
        plan = split_block(spec, sq, sk, min_dense, steps, model, rng.choice([1, 64]), force)
        check_plan(spec, sq, sk, plan, min_dense, steps)
        if not force:  # the plan is never priced above one masked call for the block
            assert plan.cost_us <= plan.masked_cost_us


def test_each_price_takes_its_path():
    spec, sq, sk = SHAPES["ragged_then_short"]
    plan = split_block(spec, sq, sk, 8, 2, GATHER, 64, True)
    gathered = DenseCall(12, 12, True, (0, 31, 77, 94), (0, 31, 77, 94), (11, 11, 11, 9), True)
    assert gathered in plan.dense  # the last one reads past the block: clamped
    plan = split_block(spec, sq, sk, 8, 2, PAD, 64, True)
    assert DenseCall(12, 12, True, (0,), (0,), (11,)) in plan.dense and plan.packed is None
    plan = split_block(spec, sq, sk, 8, 2, PACK, 64, True)
    assert plan.packed is not None and plan.packed.n == (5, 6) and plan.packed.q0 == (42, 88)
    assert plan.packed.bounds == (0, 5, 11)
    down = split_block(spec, sq, sk, 8, 2, CPU_MODEL, 64, True)
    assert MaskedCall(27, 31, 11, 31) in down.masked  # 20 rows: 16 dense, 4 left over


def test_plans_of_benchmark_mixes_under_the_gpu_prices():
    """Equal neighbours share a view call; lengths on the ladder stay exact; many short ragged
    documents run as one masked call unless forced; the ladders bound the shapes."""
    s, work = 65536, 32 * 128
    plan = split_block(MaskSpec(True, 0, 0, bounds_of(*[8192] * 8)), s, s, work=work)
    assert plan.dense == (DenseCall(8192, 8192, True, tuple(range(0, s, 8192)),
                                    tuple(range(0, s, 8192)), (8192,) * 8),)
    assert plan.masked == () and plan.packed is None and layout(plan, s, s).whole
    assert plan.cost_us < plan.masked_cost_us
    for length in (512, 1024, 2048):
        spec = MaskSpec(True, 0, 0, bounds_of(*[length] * (s // length)))
        plan = split_block(spec, s, s, work=work)
        assert [(c.sq, c.n) for c in plan.dense] == [(length, s // length)] and not plan.masked
    mix = bounds_of(20480, 12288, 9216, 7168, 5120, 4096, 2048, 2048, 2048, 1024)
    plan = split_block(MaskSpec(True, 0, 0, mix), s, s, work=work)
    assert {c.sq for c in plan.dense} >= {20480, 12288, 9216, 7168, 5120, 4096, 2048}
    assert not any(c.padded or c.gather for c in plan.dense)
    assert plan.dense_pairs > 0.99 * plan.pairs
    short = bounds_of(*lognormal_lengths(s, 1024, 0.6, 0))
    plan = split_block(MaskSpec(True, 0, 0, short), s, s, work=work)
    assert plan.dense == () and plan.masked == (MaskedCall(0, s, 0, s),)
    forced = split_block(MaskSpec(True, 0, 0, short), s, s, work=work, force_dense=True)
    assert forced.dense and forced.cost_us > plan.cost_us == plan.masked_cost_us
    shapes = {(c.n, c.sq, c.sk) for c in forced.dense}
    assert len({sq for _, sq, _ in shapes}) <= 8 * 3 + 1  # lengths of 256..4K: 8 per octave


def test_ladders():
    for steps in (1, 2, 4, 8):
        seen: dict[int, set] = {}
        for n in list(range(1, 3000)) + list(range(3000, 300000, 97)):
            down, up = ladder_down(n, steps), ladder_up(n, steps)
            step = max(1, (1 << (n.bit_length() - 1)) // steps)
            assert down % step == 0 and n - step < down <= n <= up < n + step
            assert ladder_down(up, steps) == up == ladder_up(up, steps)  # on the ladder
            seen.setdefault(n.bit_length(), set()).update({down})
        assert all(len(values) <= steps for values in seen.values())
    assert ladder_down(1100, 0) == ladder_up(1100, 0) == 1100
    assert dense_rows(1100, 1024, 0) == 1100 and dense_rows(1000, 1024, 0) == 0
    assert dense_rows(1100, 1024, 8) == 1024 and dense_rows(300, 256, 8) == 288
    for n in range(1, 200):
        sizes = batch_sizes(n)
        assert sum(sizes) == n and sizes == sorted(sizes, reverse=True)
        assert len(sizes) <= 1 + math.log(n, 3) + 1e-9  # each batch leaves under a third
        assert all(ladder_down(b, BATCH_STEPS) == b for b in sizes)
