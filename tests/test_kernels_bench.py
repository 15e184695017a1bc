"""lctrain.bench.kernel on a CPU at tiny sizes: FLOP model, timing, statuses, profile, defaults."""
import json
import statistics

import pytest
import torch

from lctrain.model.flops import attention_flops, rates
from lctrain.bench.documents import parse_documents
from lctrain.bench.kernel import DEFAULTS, run
from lctrain.bench.result import from_dict
from lctrain.bench.timing import measure, repeats_for
from lctrain.errors import ConfigError


def test_flop_model_is_the_documented_one_and_counts_only_visible_document_pairs():
    s, h, d = 1024, 32, 128
    assert attention_flops(s, h, d) == 2 * s * s * h * d
    assert attention_flops(s, h, d, causal=False) == 4 * s * s * h * d
    assert attention_flops(s, h, d, True, parse_documents("8", s).cu_seqlens) == 2 * s * s * h * d / 8
    fwd = attention_flops(s, h, d)
    got = rates(fwd, 2.0, 5.0)
    assert got["fwd_tflops"] == pytest.approx(fwd / 2e-3 / 1e12)
    assert got["bwd_tflops"] == pytest.approx(2.5 * fwd / 5e-3 / 1e12)
    assert got["total_tflops"] == pytest.approx(3.5 * fwd / 7e-3 / 1e12)
    assert rates(fwd, 2.0, None) == {"fwd_tflops": pytest.approx(fwd / 2e-3 / 1e12)}
    assert parse_documents("3", 10).cu_seqlens == (0, 3, 7, 10)  # a bare count: equal ones
    with pytest.raises(ConfigError, match="asks for 5 documents but a sequence of 4 tokens holds 1 to 4"):
        parse_documents("5", 4)


def test_timing_hands_the_forward_result_to_the_backward_and_counts_iterations():
    calls = []

    def fwd():
        calls.append("f")
        return len(calls)

    def bwd(state):
        calls.append(("b", state))

    times = measure(fwd, bwd, device=torch.device("cpu"), repeats=3, warmup=2)
    assert len(times.fwd) == len(times.bwd) == 3 and len(calls) == 10
    assert all(c == ("b", i) for i, c in enumerate(calls, 0) if isinstance(c, tuple))
    summary = times.summary()
    assert summary["total_ms"] == statistics.median(times.total)
    assert summary["total_ms_min"] <= summary["total_ms"] <= summary["total_ms_max"]
    assert repeats_for(10.0, 5, 0.0) == 5 and repeats_for(10.0, 5, 1.0) == 50
    assert repeats_for(100.0, 5, 2.0) == 20 and repeats_for(1e6, 5, 2.0) == 5


def test_cpu_run_measures_every_cpu_backend_and_checks_it():
    lines = []
    result = run([32, 48], heads=2, head_dim=16, dtype=torch.float32, kv_heads=1, repeats=2,
                 warmup=1, check_len=24, progress=lines.append)
    assert {r["backend"] for r in result.rows} == {"reference", "cpu_flash"}
    assert len(result.rows) == 4
    for row in result.rows:
        assert row["status"] == "ok" and row["correct"] is True
        assert row["max_rel_err"] < 1e-4
        assert row["fwd_ms_min"] <= row["fwd_ms"] <= row["fwd_ms_max"]
        assert row["total_tflops"] > 0 and row["relation"] == "causal"
        flops = attention_flops(row["seq_len"], 2, 16)
        want = 3.5 * flops / (row["fwd_ms"] + row["bwd_ms"]) / 1e9
        assert row["total_tflops"] == pytest.approx(want)
    doc = json.loads(result.to_json())
    assert doc["lctrain_bench"] == 1 and doc["kind"] == "kernel"
    assert doc["meta"]["device"] == "cpu" and doc["meta"]["machine"]["torch"] == torch.__version__
    assert from_dict(doc).rows == result.rows
    assert len(lines) == 6 and any("reference 48:" in line and "fwd+bwd" in line for line in lines)


def test_profile_writes_a_trace_and_splits_the_time_by_category(tmp_path):
    (row,) = run([32], backends=["cpu_flash"], heads=2, head_dim=16, dtype=torch.float32,
                 repeats=1, warmup=0, profile_dir=str(tmp_path)).rows
    trace = json.loads(open(row["trace"]).read())  # chrome trace
    assert row["trace"].startswith(str(tmp_path)) and trace["traceEvents"]
    parts = [row[f"profile_{c}_ms"] for c in ("attention", "communication", "bookkeeping", "other")]
    assert row["profile_wall_ms"] > 0 and all(p >= 0 for p in parts) and sum(parts) > 0
    assert row["profile_attention_ms"] > 0  # the CPU flash op is named as attention


def test_with_no_sizes_a_cpu_gets_small_defaults():
    result = run(backends=["cpu_flash"], repeats=1, warmup=0)
    cpu = DEFAULTS["cpu"]
    assert [r["seq_len"] for r in result.rows] == cpu["seq_lens"]
    assert result.meta["heads"] == cpu["heads"] and result.meta["dtype"] == "float32"
    assert all(r["status"] == "ok" for r in result.rows)


def test_documents_mode_and_subjects_that_cannot_run_say_why():
    result = run([64], backends=["reference", "cpu_flash", "cudnn", "flash_attn_cute"],
                 heads=2, head_dim=8, dtype=torch.bfloat16, documents=8, repeats=2, warmup=0)
    rows = {r["backend"]: r for r in result.rows}
    assert rows["reference"]["status"] == "ok" and rows["reference"]["relation"] == "partial"
    assert rows["reference"]["correct"] is True
    assert "full or causal" in rows["cpu_flash"]["status"]
    assert "total_tflops" not in rows["cpu_flash"]
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in rows["cudnn"]["status"]
        assert "flash_attn_cute" in rows["flash_attn_cute"]["status"]


def test_bad_requests_are_rejected():
    with pytest.raises(ConfigError, match="multiple of --kv-heads"):
        run([16], heads=3, kv_heads=2)
    with pytest.raises(ConfigError, match="positive sequence lengths"):
        run([0], heads=2)
    with pytest.raises(ConfigError, match="--dense-reference cudnn is the dense rate.*--documents"):
        run([16], heads=2, dense_reference="cudnn")
    with pytest.raises(ConfigError, match="--backend 'tritn' is not.*did you mean 'triton'"):
        run([16], ["reference", "tritn"], heads=2)  # a typo: refused before any measurement
    with pytest.raises(ConfigError, match="--dense-reference 'cudnnn' is not"):
        run([16], heads=2, documents=2, dense_reference="cudnnn")


def test_documents_rows_count_useful_flops_and_share_of_the_dense_reference():
    from lctrain.bench.views import summary, table
    from lctrain.report.table import render

    lines, specs = [], ["3x16,rest", "5"]
    result = run([64, 96], heads=2, head_dim=16, dtype=torch.float32, documents=specs,
                 dense_reference="cpu_flash", repeats=2, warmup=0, check_len=48,
                 progress=lines.append)
    rows = {(r["backend"], r["seq_len"], r["documents"]): r for r in result.rows}
    assert {b for b, _, _ in rows} == {"cpu_flash (dense)", "reference"}  # CPU defaults
    assert len(result.rows) == 2 + 2 * 2  # the dense reference once per length
    for seq_len in (64, 96):
        dense = rows[("cpu_flash (dense)", seq_len, None)]
        assert dense["relation"] == "causal" and "mix" not in dense
        assert dense["total_tflops"] == pytest.approx(
            3.5 * attention_flops(seq_len, 2, 16) / (dense["fwd_ms"] + dense["bwd_ms"]) / 1e9)
        for spec in specs:
            docs = parse_documents(spec, seq_len)
            for name in ("reference",):
                row = rows[(name, seq_len, spec)]
                assert row["status"] == "ok" and row["correct"] is True and row["max_rel_err"] < 1e-4
                assert row["relation"] == "partial" and row["mix"] == docs.summary()
                useful = 3.5 * attention_flops(seq_len, 2, 16, True, docs.cu_seqlens)
                assert row["total_tflops"] == pytest.approx(useful / (row["fwd_ms"] + row["bwd_ms"]) / 1e9)
                assert row["of_dense"] == pytest.approx(row["total_tflops"] / dense["total_tflops"])
                assert row["of_dense_fwd"] == pytest.approx(row["fwd_tflops"] / dense["fwd_tflops"])
                assert row["of_dense_bwd"] == pytest.approx(row["bwd_tflops"] / dense["bwd_tflops"])
    meta = result.meta
    assert (meta["documents"], meta["dense_reference"]) == (specs, "cpu_flash")
    assert meta["check_documents"] == [parse_documents(s, 64).scaled(48).summary() for s in specs]
    assert any(line.startswith("reference 5 96:") and "of dense" in line for line in lines)
    text = render(table(result), "table", terminal=True, width=80)  # a mix column numbers them
    joined = " ".join(line.strip() for line in text.splitlines())  # titles and notes wrap
    assert "mix 2: documents 5 at 96: 5 documents of 19..20 tokens, median 19" in joined
    assert max(map(len, text.splitlines())) <= 80 and "2 document mixes" in joined
    assert text.splitlines()[2].split()[:3] == ["backend", "length", "mix"]
    pivot = summary(result)  # one line per length and mix, the dense rate in each
    assert [(r["seq_len"], r["documents"]) for r in pivot.rows] == [
        (64, "3x16,rest"), (64, "5"), (96, "3x16,rest"), (96, "5")]
    assert len({r["cpu_flash (dense)"] for r in pivot.rows[:2]}) == 1


def test_documents_without_a_dense_reference_on_a_cpu_and_explicitly_off():
    auto = run([32], backends=["reference"], heads=1, head_dim=8, dtype=torch.float32,
               documents=4, repeats=1, warmup=0)
    off = run([32], backends=["reference"], heads=1, head_dim=8, dtype=torch.float32,
              documents=4, dense_reference="none", repeats=1, warmup=0)
    for result in (auto, off):
        (row,) = result.rows
        assert (row["documents"], row["mix"]) == ("4", "4 documents of 8 tokens")
        assert "of_dense" not in row and result.meta["dense_reference"] is None
