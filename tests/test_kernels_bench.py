"""lctrain.bench.kernel on a CPU at tiny sizes: rows, FLOP model, statuses, JSON, table, plot."""
import json

import pytest
import torch

from lctrain.bench.kernel import doc_bounds, forward_flops, run
from lctrain.bench.result import BenchResult


def test_flop_model_matches_perf_md_and_counts_only_visible_document_pairs():
    s, h, d = 1024, 32, 128
    assert forward_flops(s, h, d, True, None) == 2 * s * s * h * d
    assert forward_flops(s, h, d, False, None) == 4 * s * s * h * d
    assert forward_flops(s, h, d, True, doc_bounds(s, 8)) == 2 * s * s * h * d / 8
    assert doc_bounds(10, 3) == (0, 3, 7, 10)
    with pytest.raises(ValueError, match="documents must be between 1"):
        doc_bounds(4, 5)


def test_cpu_run_measures_every_cpu_backend_and_checks_it():
    result = run([32, 48], heads=2, head_dim=16, dtype=torch.float32, kv_heads=1, repeats=2,
                 warmup=1, check_len=24)
    assert {r["backend"] for r in result.rows} == {"reference", "cpu_flash"}
    assert len(result.rows) == 4
    for row in result.rows:
        assert row["status"] == "ok" and row["correct"] is True
        assert row["max_rel_err"] < 1e-4
        assert row["fwd_ms_min"] <= row["fwd_ms"] <= row["fwd_ms_max"]
        assert row["total_tflops"] > 0 and row["relation"] == "causal"
        flops = forward_flops(row["seq_len"], 2, 16, True, None)
        want = 3.5 * flops / (row["fwd_ms"] + row["bwd_ms"]) / 1e9
        assert row["total_tflops"] == pytest.approx(want)
    doc = json.loads(result.to_json())
    assert doc["meta"]["device"] == "cpu" and len(doc["rows"]) == 4
    assert result.table().row_count == 4


def test_documents_mode_and_backends_that_cannot_run_say_why():
    result = run([64], backends=["reference", "cpu_flash", "cudnn", "nope"], heads=2,
                 head_dim=8, dtype=torch.bfloat16, documents=8, repeats=2, warmup=0)
    rows = {r["backend"]: r for r in result.rows}
    assert rows["reference"]["status"] == "ok" and rows["reference"]["relation"] == "partial"
    assert rows["reference"]["correct"] is True
    assert "full or causal" in rows["cpu_flash"]["status"]
    assert "total_tflops" not in rows["cpu_flash"]
    assert "unknown attention backend 'nope'" in rows["nope"]["status"]
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in rows["cudnn"]["status"]


def test_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    result = BenchResult(title="t", rows=[{"backend": "a", "seq_len": 8, "total_tflops": 1.0},
                                          {"backend": "a", "seq_len": 16, "total_tflops": 2.0},
                                          {"backend": "b", "seq_len": 8, "status": "no"}],
                         x="seq_len", y="total_tflops", series="backend")
    path = result.plot(tmp_path / "k.png")
    assert path.stat().st_size > 1000
    with pytest.raises(ValueError, match="no x/y columns"):
        BenchResult(title="plain").plot(tmp_path / "x.png")


def test_bad_requests_are_rejected():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        run([16], heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="positive sequence length"):
        run([], heads=2)
