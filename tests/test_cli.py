"""The CLI: thin commands, one library call each, and every user mistake as one sentence."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.errors import DataError

runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, list(args))


def _fake_module(monkeypatch, name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


class FakeResult:
    def __init__(self, rows):
        self.rows = rows

    def table(self):
        from rich.table import Table

        table = Table("seq_len")
        for row in self.rows:
            table.add_row(str(row))
        return table

    def to_json(self):
        return {"rows": self.rows}

    def plot(self, path):
        open(path, "w").write("png")


def test_help_lists_the_commands():
    result = _invoke("--help")
    assert result.exit_code == 0
    for command in ("finetune", "estimate-memory", "bench"):
        assert command in result.stdout
    bench = _invoke("bench", "--help")
    for command in ("kernel", "attention", "step"):
        assert command in bench.stdout


def test_python_dash_m_lctrain_works():
    out = subprocess.run([sys.executable, "-m", "lctrain", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "estimate-memory" in out.stdout


@pytest.mark.parametrize("args", [
    ["finetune", "no-such-recipe.yaml"],
    ["finetune", "--seq-len", "12x"],
    ["finetune", "--set", "train.lrr=1"],
    ["finetune", "--set", "train.lr=abc"],
    ["finetune", "--set", "parallel.cp=3"],
    ["finetune", "--set", "model.path=/no/such/model", "--set", "model.config=null"],
    ["finetune", "--set", "parallel.schedule=context_parallel"],
    ["estimate-memory", "--gpu-memory", "80XB"],
    ["estimate-memory", "--model", "llama-7b"],
    ["estimate-memory", "--model", "llama-7b", "--seq-len", "1k", "--host-memory", "12XB"],
    ["estimate-memory", "--model", "llama-7b", "--seq-len", "1k", "--set", "train.lr=1"],
    ["estimate-memory", "tiny", "--seq-len", "100k", "--cp", "3"],
    ["bench", "kernel", "--seq-len", "16k,32q"],
    ["bench", "attention", "--seq-len", ","],
    ["bench", "step", "--set", "data.tokenizer=null"],
])
def test_user_mistakes_are_one_sentence_without_traceback(args):
    result = _invoke(*args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_usage_errors_exit_nonzero_without_traceback():
    for args in (["finetune", "--max-steps", "0"], ["finetune", "--bogus"], ["bench", "kernel",
                                                                             "--dtype", "int8"]):
        result = _invoke(*args)
        assert result.exit_code != 0 and "Traceback" not in result.output


def test_finetune_hands_the_resolved_recipe_to_the_runner(monkeypatch, tmp_path):
    calls = []
    _fake_module(monkeypatch, "lctrain.train.runner",
                 finetune=lambda cfg, *, resume=False, nproc=None: calls.append((cfg, resume, nproc)) or 3)
    result = _invoke("finetune", "--seq-len", "1k", "--set", "train.lr=1e-4", "--output-dir",
                     str(tmp_path), "--max-steps", "5", "--resume", "--nproc", "2")
    assert result.exit_code == 3, result.output
    (cfg, resume, nproc), = calls
    assert cfg.data.seq_len == 1024 and cfg.train.lr == 1e-4 and cfg.train.max_steps == 5
    assert cfg.train.output_dir == str(tmp_path) and resume is True and nproc == 2


def test_finetune_user_error_raised_by_the_runner(monkeypatch):
    def broken(cfg, **kw):
        raise DataError("data.source 'x' holds no document; point it at some text")

    _fake_module(monkeypatch, "lctrain.train.runner", finetune=broken)
    result = _invoke("finetune")
    assert result.exit_code == 1 and result.stderr.strip() == (
        "error: data.source 'x' holds no document; point it at some text")


def test_backend_unavailable_is_a_user_error(monkeypatch):
    backends = pytest.importorskip("lctrain_kernels.backends")

    def run(**kw):
        raise backends.BackendUnavailable("backend 'flash_attn' is not installed; pip install flash-attn")

    _fake_module(monkeypatch, "lctrain.bench.kernel", run=run)
    result = _invoke("bench", "kernel", "--backend", "flash_attn")
    assert result.exit_code == 1 and "flash_attn" in result.stderr and "Traceback" not in result.output


def test_bench_kernel_runs_for_real_on_a_cpu(tmp_path):
    """No fake module: the command line reaches the real bench (dtype given by name)."""
    out = tmp_path / "kernel.json"
    result = _invoke("bench", "kernel", "--seq-len", "48", "--check-len", "32", "--backend",
                     "reference", "--heads", "2", "--head-dim", "16", "--dtype", "float32",
                     "--json", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["status"] == "ok" and row["correct"] and row["seq_len"] == 48
    assert report["meta"]["check_len"] == 32 and report["meta"]["dtype"] == "float32"


def test_bad_check_len_is_one_sentence(monkeypatch):
    _fake_module(monkeypatch, "lctrain.bench.kernel", run=lambda **kw: FakeResult([]))
    result = _invoke("bench", "kernel", "--check-len", "8q")
    assert result.exit_code != 0 and "--check-len" in result.stderr
    assert "Traceback" not in result.output


def test_bugs_keep_their_traceback(monkeypatch):
    def run(**kw):
        raise RuntimeError("a bug")

    _fake_module(monkeypatch, "lctrain.bench.kernel", run=run)
    result = _invoke("bench", "kernel")
    assert isinstance(result.exception, RuntimeError)


def test_bench_commands_parse_and_publish(monkeypatch, tmp_path):
    seen = {}

    def recorder(kind):
        def run(*args, **kwargs):
            seen[kind] = (args, kwargs)
            return FakeResult([1, 2])
        return run

    for kind in ("kernel", "attention", "step"):
        _fake_module(monkeypatch, f"lctrain.bench.{kind}", run=recorder(kind))
    out, plot = tmp_path / "k" / "r.json", tmp_path / "k.png"
    result = _invoke("bench", "kernel", "--seq-len", "16k,32k", "--backend", "triton, flash",
                     "--heads", "8", "--head-dim", "64", "--dtype", "float16", "--json", str(out),
                     "--plot", str(plot), "--check-len", "8k")
    assert result.exit_code == 0, result.output
    assert seen["kernel"][1] == dict(seq_lens=[16384, 32768], backends=["triton", "flash"], heads=8,
                                     head_dim=64, dtype="float16", causal=True, documents=None,
                                     check_len=8192)
    assert json.loads(out.read_text()) == {"rows": [1, 2]} and plot.read_text() == "png"
    result = _invoke("bench", "attention", "--seq-len", "64k", "--schedule", "distflash,ring",
                     "--nproc", "4", "--kv-heads", "8", "--overlap-ablation")
    assert result.exit_code == 0, result.output
    kwargs = seen["attention"][1]
    assert kwargs["seq_lens"] == [65536] and kwargs["schedules"] == ["distflash", "ring"]
    assert kwargs["nproc"] == 4 and kwargs["kv_heads"] == 8 and kwargs["overlap_ablation"] is True
    result = _invoke("bench", "step", "llama-7b-64k", "--seq-len", "32k", "--steps", "3",
                     "--warmup", "0")
    assert result.exit_code == 0, result.output
    (cfg,), kwargs = seen["step"]
    assert cfg.data.seq_len == 32768 and kwargs == {"steps": 3, "nproc": None, "warmup": 0}


def test_estimate_memory_renders_table_and_json(monkeypatch):
    calls = []
    payload = {"parameters_count": 6_738_415_616, "fits": False, "max_seq_len": 180_224,
               "per_gpu_bytes": {"parameters": 2**30, "gradients": 2**30, "optimizer": 2**32,
                                 "activations": 2**36, "other": 2**30, "total": 2**37}}

    def estimate_recipe(cfg, **kwargs):
        calls.append((cfg, kwargs))
        return types.SimpleNamespace(to_json=lambda: payload)

    _fake_module(monkeypatch, "lctrain.memory", estimate_recipe=estimate_recipe)
    result = _invoke("estimate-memory", "llama-7b-256k", "--seq-len", "512k", "--gpus", "8",
                     "--gpu-memory", "80GiB", "--cp", "8", "--checkpointing", "remat-offload",
                     "--host-memory", "1TiB", "--gpus-per-node", "4")
    assert result.exit_code == 0, result.output
    assert "activations" in result.stdout and "64.0 GiB" in result.stdout and "176k" in result.stdout
    cfg, kwargs = calls[-1]
    assert cfg.data.seq_len == 524288 and cfg.parallel.cp == 8
    assert kwargs == dict(model=None, seq_len=524288, gpus=8, gpu_memory=80 * 2**30, cp=8,
                          policy="remat-offload", host_memory=2**40, gpus_per_node=4)
    result = _invoke("estimate-memory", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "64k",
                     "--gpu-memory", "80GB", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == payload
    assert calls[-1] == (None, dict(model="meta-llama/Llama-2-7b-hf", seq_len=65536, gpus=1,
                                    gpu_memory=80 * 10**9, cp=None, policy=None,
                                    host_memory=None, gpus_per_node=None))


def test_estimate_memory_with_the_real_memory_model():
    memory = pytest.importorskip("lctrain.memory")
    if not hasattr(memory, "estimate_recipe"):
        pytest.skip("lctrain.memory.estimate_recipe not built yet")
    result = _invoke("estimate-memory", "llama-7b-64k", "--gpus", "8", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["per_gpu_bytes"]["total"] > 0
