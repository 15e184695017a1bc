"""The benches on a CUDA GPU (``pytest -m gpu``; skipped without one).

* our Triton kernels err at most twice as much as torch's own bf16 attention (cuDNN) against float32
  math at 8K tokens of Llama-7B's attention (32 heads of 128);
* the flash_attn_cute backend computes the same attention as float32 math (causal and packed
  documents);
* ``lctrain bench kernel`` through a pipe prints every number it measured; with packed
  documents its rows carry the share of cuDNN's dense rate;
* ``lctrain bench attention`` on two GPUs: every schedule correct, a profile per rank; with
  packed documents too (the single-GPU row is what auto picks on this GPU).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


def _check(name: str, seq_len: int, documents=None, heads=32, head_dim=128) -> float:
    from lctrain.bench.documents import parse_documents
    from lctrain.bench.kernel import check_correctness
    from lctrain_kernels.api import BackendUnavailable, get_backend

    bounds = None if documents is None else parse_documents(str(documents), seq_len).cu_seqlens
    try:
        return check_correctness(get_backend(name), seq_len, heads, heads, head_dim,
                                 torch.bfloat16, torch.device("cuda"), True, bounds)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))


def test_triton_errs_at_most_twice_torch_cudnn_at_8k():
    ours, torchs = _check("triton", 8192), _check("cudnn", 8192)
    assert ours <= max(2 * torchs, 1e-3), (ours, torchs)


@pytest.mark.parametrize("documents", [None, 8, "700,300,1k,rest"])
def test_fa4_computes_the_same_attention(documents):
    err = _check("flash_attn_cute", 2048, documents, heads=8, head_dim=64)
    assert err < 4e-2


def test_bench_kernel_through_a_pipe_prints_every_number(tmp_path):
    out = tmp_path / "k.json"
    run = subprocess.run([sys.executable, "-m", "lctrain", "bench", "kernel", "--seq-len", "4k,8k",
                          "--backend", "triton,cudnn", "--check-len", "2k", "--json", str(out)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 4 and all(r["status"] == "ok" for r in result["rows"])
    assert result["meta"]["machine"]["gpu"] and result["meta"]["command"].startswith("lctrain bench")
    for row in result["rows"]:
        line = next(line for line in run.stdout.splitlines()
                    if line.startswith(row["backend"]) and f" {row['seq_len'] // 1024}K " in line)
        assert "…" not in line and len(line.split()) >= 6, line  # every column, nothing cut


def test_bench_kernel_with_documents_shares_the_dense_rate(tmp_path):
    out = tmp_path / "d.json"
    run = subprocess.run([sys.executable, "-m", "lctrain", "bench", "kernel", "--seq-len", "16k",
                          "--documents", "4k,3k,2x2k,1k,rest", "--backend", "cudnn_ragged,triton,cudnn",
                          "--check-len", "4k", "--json", str(out)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["cudnn (dense)"]["status"] == "ok" and rows["cudnn (dense)"]["relation"] == "causal"
    for name in ("cudnn_ragged", "triton"):
        row = rows[name]
        if name == "cudnn_ragged" and not _loads(name):  # the cuDNN frontend is optional
            assert "pip install nvidia-cudnn-frontend" in row["status"]
            continue
        assert row["status"] == "ok" and row["correct"] is True, row
        assert row["of_dense"] == pytest.approx(row["total_tflops"] / rows["cudnn (dense)"]["total_tflops"])
        assert row["documents"] == "4k,3k,2x2k,1k,rest"
    assert "document" in rows["cudnn"]["status"]  # cudnn refuses document blocks and says so
    assert "documents 4k,3k,2x2k,1k,rest at 16K: 6 documents" in run.stdout  # rest = 4k


def _loads(name: str) -> bool:
    from lctrain_kernels.api import BackendUnavailable, get_backend

    try:
        get_backend(name)
    except BackendUnavailable:
        return False
    return True


def _auto_backend(documents: bool) -> str:
    """The first backend of auto's bf16 order that loads on this GPU, by independent probing."""
    order = (("flash_attn_cute", "cudnn_ragged", "triton") if documents
             else ("flash_attn_cute", "cudnn", "triton"))
    return next((name for name in order if _loads(name)), "no GPU attention backend loads")


def test_bench_attention_on_two_gpus_is_correct_and_profiles_each_rank(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from lctrain.bench.dist_attention import run

    result = run([16384], nproc=2, repeats=2, warmup=1, check_len=4096, profile_dir=str(tmp_path))
    rows = {r["variant"]: r for r in result.rows}
    for name in ("distflash", "zigzag", "ring", "distflash (no overlap)"):
        assert rows[name]["status"] == "ok" and rows[name]["correct"] is True, rows[name]
        assert rows[name]["profile_attention_ms"] > 0
    single = rows[f"single-gpu {_auto_backend(documents=False)}"]  # what auto runs here
    assert rows["distflash"]["vs_single"] == pytest.approx(
        rows["distflash"]["total_tflops"] / single["total_tflops"])
    traces = {p.name for p in tmp_path.iterdir()}
    assert {"attention-distflash-16384-rank0.json", "attention-distflash-16384-rank1.json"} <= traces
    packed = run([16384], ["distflash"], nproc=2, overlap_ablation=False, repeats=2, warmup=1,
                 check_len=4096, documents="lognormal:mean=3k")
    rows = {r["variant"]: r for r in packed.rows}
    assert rows["distflash"]["status"] == "ok" and rows["distflash"]["correct"] is True
    single = rows[f"single-gpu {_auto_backend(documents=True)}"]
    assert single["status"] == "ok" and rows["distflash"]["vs_single"] == pytest.approx(
        rows["distflash"]["total_tflops"] / single["total_tflops"])
    assert "no document mask" in rows["context_parallel"]["status"]
