"""The distributed attention bench on 2 CPU ranks (gloo): rows, correctness gate, peers' reasons,
progress, limits, profiles."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from lctrain_kernels.distributed.balance import balanced_order, document_work

from lctrain.bench.dist_attention import run
from lctrain.errors import ConfigError

LINES: list[str] = []


def collect(line: str) -> None:
    """Progress sink (module level: it travels to the spawned ranks, which print it)."""
    print(f"progress: {line}", file=sys.stderr, flush=True)


def test_bench_rows_on_two_cpu_ranks(capfd):
    result = run([32, 64], nproc=2, heads=2, kv_heads=1, head_dim=8, dtype=torch.float32, repeats=2,
                 warmup=1, backend="reference", single_max_len=32, progress=collect)
    rows = {(r["seq_len"], r["variant"]): r for r in result.rows}
    names = {"single-gpu reference", "distflash", "zigzag", "ring", "distflash (no overlap)",
             "context_parallel"}
    assert {v for _, v in rows} == names and {s for s, _ in rows} == {32, 64}
    for seq_len in (32, 64):
        for name in ("distflash", "zigzag", "ring", "distflash (no overlap)"):
            row = rows[(seq_len, name)]
            assert row["status"] == "ok" and row["correct"] is True, row
            assert row["max_rel_err"] < 1e-4 and row["total_tflops"] > 0
        assert "needs CUDA" in rows[(seq_len, "context_parallel")]["status"]
        assert rows[(seq_len, "distflash")]["repeats"] == 2  # no min_time_s: exactly repeats
        assert 0.0 <= rows[(seq_len, "distflash")]["hidden_share"] <= 1.0
    # the single-GPU reference runs up to single_max_len only; the ratio exists where it ran
    assert rows[(32, "single-gpu reference")]["total_tflops"] > 0 and rows[(32, "ring")]["vs_single"] > 0
    assert "single-GPU limit 32" in rows[(64, "single-gpu reference")]["status"]
    assert "vs_single" not in rows[(64, "distflash")]
    assert rows[(64, "distflash")]["balance"] == 1.0 and rows[(64, "ring")]["balance"] == 1.5
    doc = json.loads(result.to_json())
    assert doc["kind"] == "attention" and doc["meta"]["nproc"] == 2
    assert "progress" not in doc["meta"] and doc["meta"]["single_max_len"] == 32
    err = capfd.readouterr().err
    assert "progress: distflash: error" in err and "progress: ring 64K" not in err
    assert "progress: ring 64: fwd" in err and "progress: context_parallel 32: torch" in err


def test_min_time_and_profile(tmp_path):
    """Short lengths repeat until min_time_s; --profile writes a trace per rank."""
    result = run([32], ["distflash"], nproc=2, heads=2, head_dim=8, dtype=torch.float32,
                 overlap_ablation=False, peers=False, repeats=2, warmup=1, backend="reference",
                 min_time_s=0.3, profile_dir=str(tmp_path))
    rows = {(r["seq_len"], r["variant"]): r for r in result.rows}
    single, ours = rows[(32, "single-gpu reference")], rows[(32, "distflash")]
    assert ours["status"] == "ok" and ours["correct"] is True
    assert 2 <= single["repeats"] <= 50 and 2 < ours["repeats"] <= 50  # tiny: more than 2
    assert result.meta["min_time_s"] == 0.3
    traces = sorted(p.name for p in tmp_path.iterdir())
    assert traces == ["attention-distflash-32-rank0.json", "attention-distflash-32-rank1.json"]
    assert ours["profile_wall_ms"] > 0 and ours["trace"].endswith("rank0.json")


def test_bench_rejects_lengths_the_layouts_cannot_split():
    with pytest.raises(ConfigError, match="multiple of 4"):
        run([30], nproc=2)
    with pytest.raises(ConfigError, match="--check-len 6 is not divisible by 4"):
        run([32], nproc=2, check_len=6)
    with pytest.raises(ConfigError, match="unknown schedule"):
        run([32], schedules=["tree"], nproc=2)


def test_packed_documents_reach_every_variant_and_count_useful_flops():
    """Documents crossing the chunk boundaries of 2 ranks: the check runs the mix scaled to its
    length, rates count only the pairs inside documents, peers say they take no document mask."""
    from lctrain.bench.documents import parse_documents
    from lctrain.model.flops import attention_flops

    result = run([64], ["distflash"], nproc=2, heads=2, kv_heads=1, head_dim=8, dtype=torch.float32,
                 repeats=2, warmup=1, check_len=32, documents="3x20,rest")
    rows = {r["variant"]: r for r in result.rows}
    docs = parse_documents("3x20,rest", 64)
    useful = 3.5 * attention_flops(64, 2, 8, True, docs.cu_seqlens)  # forward + backward
    assert set(rows) == {"single-gpu reference", "distflash", "distflash (no overlap)",
                         "context_parallel"}
    assert all((r["documents"], r["mix"]) == ("3x20,rest", docs.summary()) for r in rows.values())
    for name in ("distflash", "distflash (no overlap)"):
        row = rows[name]
        assert row["status"] == "ok" and row["correct"] is True and row["max_rel_err"] < 1e-4
        per_gpu = useful / 2  # useful FLOPs of the whole sequence, per GPU
        assert row["total_tflops"] == pytest.approx(per_gpu / (row["fwd_ms"] + row["bwd_ms"]) / 1e9)
    single = rows["single-gpu reference"]
    assert single["total_tflops"] == pytest.approx(
        useful / (single["fwd_ms"] + single["bwd_ms"]) / 1e9)
    assert 0.0 <= rows["distflash"]["hidden_share"] <= 1.0
    assert "takes no document mask" in rows["context_parallel"]["status"]
    assert result.meta["documents"] == "3x20,rest"
    assert result.meta["check_documents"] == "4 documents of 2..10 tokens, median 10"
    assert result.meta["balance_documents"] is True


@pytest.mark.parametrize("balance", [True, False])
def test_the_balance_figure_is_the_documents_own_in_the_order_timed(balance):
    """A long last document leaves rank 1 with most of the work in packed order, even with all
    the shared block's rows but one on rank 0; balanced, it straddles the ranks' boundary."""
    result = run([64], ["distflash"], nproc=2, heads=2, kv_heads=1, head_dim=8, dtype=torch.float32,
                 repeats=1, warmup=0, check_len=32, documents="6,6,6,6,rest",
                 overlap_ablation=False, peers=False, balance_documents=balance)
    lengths = [6, 6, 6, 6, 40]
    order = balanced_order(lengths, 64, 2) if balance else range(5)
    work = document_work([lengths[i] for i in order], 64, 2)
    row = next(r for r in result.rows if r["variant"] == "distflash")
    assert row["status"] == "ok" and row["correct"] is True
    assert row["balance"] == pytest.approx(max(work) * 2 / sum(work))
    assert (row["balance"] < 1.1) == balance  # packed: 528 of 904 pairs on rank 1
