"""Packed documents reordered so the ranks' attention work is even.

* the work model counts, per rank, exactly the causal pairs inside documents of the blocks the
  schedule gives it (against a pair-by-pair count, every schedule, 1 to 4 ranks);
* distflash's split of its shared blocks leaves the busiest rank with the least work of every
  split (pair by pair), and half where the documents give no reason to move it;
* its cuts of the diagonal blocks bring two ranks to each transfer between them with no more
  difference in work done than the half cuts, and as little as any pair of cuts on 2 ranks
  (pair by pair); one sequence keeps the half;
* the search returns a permutation that never leaves the busiest rank with more work than the
  packed order, and evens out the benchmark's 128K row of documents of median 16K;
* the deal that starts it gives each document to the least loaded rank: its orders and balance
  figures on fixed mixes, worked out by hand;
* a batch's documents move with every column and their bounds;
* two gloo ranks train on reordered rows to the losses of the packed order.
"""
from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from lctrain_kernels.distributed import local_spans, make_schedule
import numpy as np
from lctrain_kernels.distributed.balance import (MOVE, SPLITS, balanced_cuts, balanced_order,
                                                 balanced_split, document_work)

from lctrain.bench.documents import parse_documents
from lctrain.config import load_recipe
from lctrain.data import PackedBatch, iter_batches, load_tokenizer, prepare_data, reorder_documents
from spawn import run_on_ranks


def _pairs_by_rank(lengths, n, world, kind, split=Fraction(1, 2)):
    """Pair by pair: every (query, key) of every block, visible when causal in one document."""
    schedule = make_schedule(world, kind)
    doc = [i for i, d in enumerate(lengths) for _ in range(d)]
    work = [0] * world
    for step in schedule.plan("forward", True, split).steps:
        for b in step.blocks:
            for _, q0, ql in local_spans(n, world, b.q_owner, schedule.layout,
                                         *b.q_rows.resolve(n // world)):
                for _, k0, kl in local_spans(n, world, b.kv_owner, schedule.layout,
                                             *b.kv_rows.resolve(n // world)):
                    work[b.rank] += sum(doc[i] == doc[j] for i in range(q0, q0 + ql)
                                        for j in range(k0, min(k0 + kl, i + 1)))
    return work


def _draw(n, longest, rng):
    lengths = []
    while sum(lengths) < n:
        lengths.append(min(n - sum(lengths), rng.randint(1, longest)))
    return lengths


@pytest.mark.parametrize("kind,world", [("distflash", 1), ("distflash", 2), ("distflash", 3),
                                        ("distflash", 4), ("zigzag", 2), ("zigzag", 3),
                                        ("ring", 3)])
def test_the_work_of_each_rank_is_every_visible_pair_of_its_blocks(kind, world):
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    n = 24 * world
    for _ in range(3):
        lengths = _draw(n, 30, rng)
        split = balanced_split(lengths, n, world, kind)
        assert document_work(lengths, n, world, kind) == _pairs_by_rank(lengths, n, world, kind,
                                                                        split)
    one = [n]  # one causal sequence: the schedule's own balance figure
    work = document_work(one, n, world, kind)
    assert max(work) * world / sum(work) == pytest.approx(make_schedule(world, kind).balance(),
                                                          rel=0.1)


@pytest.mark.parametrize("world", [2, 4])
def test_the_split_leaves_the_busiest_rank_the_least_work_of_every_split(world):
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    n = 64 * world  # a rank's rows split at every multiple of 1/SPLITS
    for _ in range(2):
        lengths = _draw(n, 90, rng)
        busiest = [max(_pairs_by_rank(lengths, n, world, "distflash", Fraction(k, SPLITS)))
                   for k in range(1, SPLITS)]
        split = balanced_split(lengths, n, world)
        assert max(document_work(lengths, n, world)) == min(busiest)
        assert busiest[int(split * SPLITS) - 1] == min(busiest)
    # one document: the shared blocks are as full as every other, so the half stays
    assert balanced_split([n], n, world) == Fraction(1, 2)
    if world == 2:  # a document from a quarter on: rank 0 takes three quarters of the shared
        assert balanced_split([n // 4, n - n // 4], n, 2) == Fraction(1, 4)  # block's rows
    assert balanced_split([n], n, world, "zigzag") == Fraction(1, 2)  # zigzag splits nothing


def _cut_cost(lengths, n, world, split, cuts):
    """Pair by pair (a visibility matrix): the summed difference between the work two ranks
    have done when they post each transfer between them (after step b: its results and step
    b + 2's inputs), plus 1/MOVE of the work the cuts move into the first step."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    seen = (doc[:, None] == doc[None, :]) & np.tri(n, dtype=bool)

    def work(cuts):
        plan = make_schedule(world).plan("forward", True, split, cuts)
        done = np.zeros((len(plan.steps), world), dtype=np.int64)
        for k, step in enumerate(plan.steps):
            for b in step.blocks:
                for _, q0, ql in local_spans(n, world, b.q_owner, "contiguous",
                                             *b.q_rows.resolve(n // world)):
                    for _, k0, kl in local_spans(n, world, b.kv_owner, "contiguous",
                                                 *b.kv_rows.resolve(n // world)):
                        done[k, b.rank] += seen[q0:q0 + ql, k0:k0 + kl].sum()
        return plan.steps, done

    steps, done = work(cuts)
    moved = (done[0] - work((Fraction(1, 2),) * world)[1][0]).sum()
    done = np.cumsum(done, axis=0)
    spread = sum(abs(int(done[b, m.src] - done[b, m.dst])) for b in range(len(steps) - 1)
                 for m in (*steps[b].outputs,
                           *(steps[b + 2].inputs if b + 2 < len(steps) else ())))
    return spread, spread + moved / MOVE


@pytest.mark.parametrize("world", [2, 4])
def test_the_cuts_bring_two_ranks_to_their_transfers_together(world):
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    n = 64 * world  # a rank's rows cut at every multiple of 1/SPLITS
    half = (Fraction(1, 2),) * world
    for _ in range(3):
        lengths = _draw(n, 90, rng)
        split = balanced_split(lengths, n, world)
        cuts = balanced_cuts(lengths, n, world, "distflash", split)
        assert all(Fraction(1, 2) <= c < 1 and (c * SPLITS).denominator == 1 for c in cuts)
        spread, cost = _cut_cost(lengths, n, world, split, cuts)
        assert cost <= _cut_cost(lengths, n, world, split, half)[1]
        if world == 2:  # every pair of cuts from the half on
            options = [Fraction(g, SPLITS) for g in range(SPLITS // 2, SPLITS)]
            assert cost == min(_cut_cost(lengths, n, 2, split, (a, b))[1]
                               for a in options for b in options)
    assert balanced_cuts([n], n, world) == half  # one sequence: every rank's steps alike
    assert balanced_cuts([n // 2] * 2, n, world, "zigzag") == half  # zigzag cuts nothing
    # the benchmark's row: at the half cuts rank 0 posts its results after a quarter less work
    # than rank 1, whose transfer it then waits on; its cut moves up to meet it
    lengths = [32955, 52681, 13632, 16925, 14879]
    split = balanced_split(lengths, 131072, 2)
    assert balanced_cuts(lengths, 131072, 2, "distflash", split) == (Fraction(43, 64),
                                                                     Fraction(33, 64))


def test_the_order_found_never_loads_the_busiest_rank_more():
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    for world, kind in [(2, "distflash"), (3, "distflash"), (4, "zigzag")]:
        n = 8192 * world
        for _ in range(5):
            lengths = _draw(n, rng.choice([500, 3000, 12000]), rng)
            order = balanced_order(lengths, n, world, kind)
            assert sorted(order) == list(range(len(lengths)))
            before = document_work(lengths, n, world, kind)
            after = document_work([lengths[i] for i in order], n, world, kind)
            assert sum(after) == sum(before) and max(after) <= max(before)
    assert balanced_order([5, 7], 12, 1) == (0, 1) and balanced_order([12], 12, 2) == (0,)



@pytest.mark.parametrize("kind, world, lengths, dealt, balance", [
    # rooms 32 | 32: 16 -> 0, 16 -> 1, then the 8s alternate (equal loads: the first chunk)
    ("distflash", 2, [16, 16, 8, 8, 8, 8], (0, 2, 4, 1, 3, 5), 1.0),
    # 20 -> 0 (load 400), 12, 12 and 8 -> 1 (144, 288, 352), the last 8 and 4 fit only chunk 0:
    # pairs 210 + 36 + 10 = 256 against 78 + 78 + 36 = 192
    ("distflash", 2, [20, 12, 12, 8, 8, 4], (0, 4, 5, 1, 2, 3), 256 * 2 / 448),
    # loads 144 | 100, 181, 208 | 230, 244 | 266, then 4 and 2 fit chunk 0: pairs 148 | 149
    ("distflash", 2, [12, 10, 9, 8, 7, 6, 6, 4, 2], (0, 3, 5, 7, 8, 1, 2, 4, 6), 149 * 2 / 297),
    # chunks of 16 owned by ranks 0, 1, 1, 0: 12 -> c0, 10 -> c1, 9 -> c2, 8 -> c3 (the only
    # room), 7 -> c2, 6 -> c3, 6 -> c1, 4 -> c0, 2 -> c3: pairs 88 + 60 | 76 + 73
    ("zigzag", 2, [12, 10, 9, 8, 7, 6, 6, 4, 2], (0, 7, 1, 6, 2, 4, 3, 5, 8), 149 * 2 / 297),
    # three rooms of 16: the 8s, then the 6s, then the 2s go one to each rank
    ("distflash", 3, [8, 8, 8, 6, 6, 6, 2, 2, 2], (0, 3, 6, 1, 4, 7, 2, 5, 8), 1.0),
])
def test_the_deal_gives_each_document_to_the_least_loaded_rank(kind, world, lengths, dealt,
                                                                balance):
    """Longest first, each document goes into the chunk whose rank has the least work so far
    (n² per document) among the chunks it fits in; with four evaluations (the starting orders
    only) the deal is the order found, and its balance is counted pair by pair."""
    n = sum(lengths)
    order = balanced_order(lengths, n, world, kind, evaluations=4)
    assert order == dealt
    work = _pairs_by_rank([lengths[i] for i in order], n, world, kind)
    assert max(work) * world / sum(work) == pytest.approx(balance, rel=1e-12)

def test_the_benchmark_row_of_documents_is_evened_out():
    lengths = parse_documents("lognormal:median=16k", 131072).lengths
    before = document_work(lengths, 131072, 2)
    order = balanced_order(lengths, 131072, 2)
    after = document_work([lengths[i] for i in order], 131072, 2)
    assert max(before) * 2 / sum(before) > 1.2 and max(after) * 2 / sum(after) < 1.02


def test_reordered_documents_carry_every_column_and_bound():
    lengths = [3, 5, 2, 6]
    bounds = (0, 3, 8, 10, 16)
    ids = torch.randint(0, 1000, (2, 16))
    labels = torch.randint(0, 1000, (2, 16))
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, 16)
    batch = PackedBatch(ids, labels, positions, cu_seqlens=bounds)
    moved = reorder_documents(batch, (3, 0, 2, 1))
    assert moved.cu_seqlens == (0, 6, 9, 11, 16)
    for new, old in zip(range(4), (3, 0, 2, 1)):
        a, b = moved.cu_seqlens[new], moved.cu_seqlens[new + 1]
        for name in ("input_ids", "labels", "position_ids"):
            assert torch.equal(getattr(moved, name)[:, a:b],
                               getattr(batch, name)[:, bounds[old]:bounds[old + 1]])
    assert reorder_documents(batch, range(4)) is batch


def _cfg(out: Path, data: Path):
    sets = {"data.source": str(data), "data.seq_len": 96, "train.max_steps": 4,
            "train.warmup_steps": 1, "train.lr": 3e-3, "parallel.cp": 2, "parallel.fsdp": "off",
            "parallel.attention_backend": "reference", "checkpoint.export_final": False}
    return load_recipe(None, [f"{k}={v}" for k, v in sets.items()], output_dir=str(out))


def _train(rank, world, cfgs, balances):
    """Each run of the runner, the documents balanced or (the test's reference) not."""
    from lctrain.parallel.context import ContextParallel
    from lctrain.train import runner

    records = []
    for cfg, balance in zip(cfgs, balances):
        runner.ContextParallel = lambda *args, **kw: ContextParallel(*args, **{**kw,
                                                                              "balance": balance})
        assert runner.run_worker(cfg) == 0
        path = Path(cfg.train.output_dir) / "metrics.jsonl"
        records.append([json.loads(line) for line in path.read_text().splitlines()])
    return records


def test_two_ranks_train_on_balanced_rows_as_on_the_packed_order(tmp_path):
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    for draw in range(20):  # fresh documents until the first four rows need some reordering
        data = tmp_path / f"docs{draw}.jsonl"
        data.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdef ") for _ in range(
            rng.choice([2, 4, 6, 60])))}) + "\n" for _ in range(120)))
        packed, balanced = _cfg(tmp_path / "packed", data), _cfg(tmp_path / "balanced", data)
        rows = prepare_data(balanced.data, load_tokenizer(balanced))
        batches = iter_batches(rows, batch_size=1, dp_rank=0, dp_size=1, seed=balanced.train.seed)
        moved = 0
        for _, batch in zip(range(4), batches):
            lengths = [b - a for a, b in zip(batch.cu_seqlens, batch.cu_seqlens[1:])]
            moved += balanced_order(lengths, 96, 2) != tuple(range(len(lengths)))
        if moved:
            break
    assert moved >= 1  # the test's rows do get reordered
    want, got = run_on_ranks(_train, 2, [packed, balanced], [False, True])[0]
    assert len(want) == 4 and [r["loss"] for r in got] == pytest.approx(
        [r["loss"] for r in want], rel=1e-5)
    # the gradients' scale, which AdamW's steps hardly show: their norms before clipping
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want],
                                                          rel=1e-5)
    before = [r["attention_balance"] for r in want]  # the busiest rank's work over the mean
    after = [r["attention_balance"] for r in got]
    assert all(a <= b for a, b in zip(after, before)) and sum(after) < sum(before)
