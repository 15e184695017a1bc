"""The distributed attention bench on 2 CPU ranks (gloo): rows, correctness gate, peers' reasons."""
from __future__ import annotations

import json

import pytest
import torch

from lctrain.bench.attention import run


def test_bench_rows_on_two_cpu_ranks():
    result = run([32, 64], nproc=2, heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, repeats=2,
                 warmup=1, backend="reference")
    rows = {(r["seq_len"], r["variant"]): r for r in result.rows}
    names = {"single-gpu reference", "distflash", "zigzag", "ring", "distflash (no overlap)",
             "context_parallel", "ring_flash_attn"}
    assert {v for _, v in rows} == names and {s for s, _ in rows} == {32, 64}
    for seq_len in (32, 64):
        for name in ("distflash", "zigzag", "ring", "distflash (no overlap)"):
            row = rows[(seq_len, name)]
            assert row["status"] == "ok" and row["correct"] is True, row
            assert row["max_rel_err"] < 1e-4 and row["total_tflops"] > 0 and row["vs_single"] > 0
        assert "needs CUDA" in rows[(seq_len, "context_parallel")]["status"]
        assert rows[(seq_len, "single-gpu reference")]["total_tflops"] > 0
        assert rows[(seq_len, "distflash")]["repeats"] == 2  # no min_time_s: exactly repeats
        assert 0.0 <= rows[(seq_len, "distflash")]["hidden_share"] <= 1.0
    assert rows[(64, "distflash")]["balance"] == 1.0 and rows[(64, "ring")]["balance"] == 1.5
    assert json.loads(result.to_json())["meta"]["nproc"] == 2
    assert result.table().row_count == len(result.rows)


def test_short_measurements_repeat_until_min_time():
    result = run([32], ["distflash"], nproc=2, heads=2, head_dim=8, dtype=torch.float32,
                 overlap_ablation=False, peers=False, repeats=2, warmup=1, backend="reference",
                 min_time_s=0.3)
    rows = {r["variant"]: r for r in result.rows}
    single, ours = rows["single-gpu reference"], rows["distflash"]
    assert ours["status"] == "ok" and ours["correct"] is True
    assert 2 <= single["repeats"] <= 50 and 2 < ours["repeats"] <= 50  # tiny: more than 2
    assert result.meta["min_time_s"] == 0.3


def test_bench_rejects_lengths_the_layouts_cannot_split():
    with pytest.raises(ValueError, match="multiple of 4"):
        run([30], nproc=2)
    with pytest.raises(ValueError, match="unknown schedule"):
        run([32], schedules=["tree"], nproc=2)
