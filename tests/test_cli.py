"""The CLI: thin commands, one library call each, and every user mistake as one sentence."""
from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
import types

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import save_resolved
from lctrain.errors import DataError

runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, list(args))


def _fake_module(monkeypatch, name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _result(kind: str, rows=None):
    from lctrain.bench.result import BenchResult

    rows = rows if rows is not None else [
        {"seq_len": 1024, "backend": "a", "variant": "a", "status": "ok", "total_tflops": 1.0,
         "step_time_s": 1.0, "tokens_per_s": 2.0}]
    return BenchResult(kind=kind, title=kind, rows=rows)


MODULES = {"attention": "dist_attention"}  # bench command -> its module


def _record(monkeypatch, kind: str, result=None) -> list:
    """Replace lctrain.bench.<kind>.run by a recorder returning a real (tiny) result."""
    module = importlib.import_module(f"lctrain.bench.{MODULES.get(kind, kind)}")
    calls = []

    def run(*args, **kwargs):
        calls.append((args, kwargs))
        return result if result is not None else _result(kind)

    monkeypatch.setattr(module, "run", run)
    return calls


def test_help_lists_the_commands():
    result = _invoke("--help")
    assert result.exit_code == 0
    for command in ("finetune", "estimate-memory", "bench", "report"):
        assert command in result.stdout
    bench = _invoke("bench", "--help")
    for command in ("kernel", "attention", "step", "report"):
        assert command in bench.stdout


@pytest.mark.parametrize("command", [[], ["finetune"], ["estimate-memory"], ["report"],
                                     ["bench", "kernel"], ["bench", "attention"],
                                     ["bench", "step"], ["bench", "report"]])
def test_help_shows_words_not_type_placeholders(command):
    text = _invoke(*command, "--help").stdout
    assert "Usage:" in text
    for placeholder in ("<bool>", "<int", "<float", "INTEGER", "FLOAT"):
        assert placeholder not in text, (command, placeholder)


def test_estimate_memory_help_lists_the_presets():
    from lctrain.memory import PRESETS

    text = " ".join(_invoke("estimate-memory", "--help").stdout.split())
    assert all(name in text for name in PRESETS)


def test_version_names_lctrain_torch_triton_transformers():
    import torch

    result = _invoke("--version")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].startswith("lctrain ") and f"torch {torch.__version__}" in lines
    assert any(line.startswith("triton ") for line in lines)
    assert any(line.startswith("transformers ") for line in lines)
    assert lines[-1].startswith("CUDA")


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
    ["estimate-memory", "--gpu-memory", "141"],
    ["bench", "kernel", "--seq-len", "64", "--backend", "reference,tritn"],
    ["bench", "kernel", "--seq-len", "64", "--documents", "2xgarbage"],
    ["bench", "step", "--variant", "bogus"],
    ["bench", "step", "--variant", "train.lr='1"],
    ["estimate-memory", "--model", "llama-7b"],
    ["estimate-memory", "--model", "llama-7b", "--seq-len", "1k", "--host-memory", "12XB"],
    ["estimate-memory", "--model", "llama-7b", "--seq-len", "1k", "--set", "train.lr=1"],
    ["estimate-memory", "tiny", "--seq-len", "100k", "--cp", "3"],
    ["estimate-memory", "--model", "no-such-org/no-such-model", "--seq-len", "1k"],
    ["bench", "kernel", "--plot", "kernel.txt"],
    ["bench", "step", "--variant", "train.lrr=1"],
    ["bench", "report", "no-such-file.json"],
    ["report", "no-such-run"],
    ["bench", "kernel", "--seq-len", "16k,32q"],
    ["bench", "attention", "--seq-len", ","],
    ["bench", "step", "--set", "data.tokenizer=null"],
    ["finetune", "--set", "model.config.rms_norm_eps=abc"],
    ["finetune", "--set", "model.config.rope_parameters=5"],
    ["finetune", "--set", "model.config.rope_parameters={rope_type: bogus, rope_theta: 1.0}"],
    ["finetune", "--set", "model.config.hidden_act=foo"],
    ["finetune", "--set", "model.config.num_hidden_layers=100000000000"],
    ["estimate-memory", "--set", "model.config.num_hidden_layers=100000000000"],
    ["finetune", "--set", "train.collective_timeout=1e30"],
])
def test_user_mistakes_are_one_sentence_without_traceback(args):
    result = _invoke(*args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_unwritable_result_files_are_refused_before_any_work(tmp_path):
    """--json and --plot are tried before the measurement or evaluation: one sentence, and no
    progress line (nothing ran, so nothing is lost); a checked folder keeps no scratch file."""
    pytest.importorskip("matplotlib")
    blocker, folder = tmp_path / "a-file", tmp_path / "folder"
    blocker.write_text("x")
    folder.mkdir()
    kernel = ["bench", "kernel", "--seq-len", "64", "--backend", "reference", "--repeats", "1"]
    for args, words in [([*kernel, "--json", str(blocker / "r.json")], "cannot be written"),
                        ([*kernel, "--plot", str(blocker / "p.png")], "cannot be written"),
                        ([*kernel, "--json", str(folder)], "is a folder"),
                        (["report", str(tmp_path), "--plot", str(blocker / "p.png")],
                         "cannot be written"),
                        (["eval", str(tmp_path), "--json", str(blocker / "r.json")],
                         "cannot be written")]:
        result = _invoke(*args)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 1 and len(lines) == 1, result.output
        assert lines[0].startswith("error: --") and words in lines[0], lines
    result = _invoke(*kernel, "--json", str(folder / "deeper" / "r.json"))
    assert result.exit_code == 0, result.output
    assert [p.name for p in (folder / "deeper").iterdir()] == ["r.json"]


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
                     str(tmp_path), "--max-steps", "5", "--nproc", "2")
    assert result.exit_code == 3, result.output
    (cfg, resume, nproc), = calls
    assert cfg.data.seq_len == 1024 and cfg.train.lr == 1e-4 and cfg.train.max_steps == 5
    assert cfg.train.output_dir == str(tmp_path) and resume is False and nproc == 2
    save_resolved(cfg, tmp_path / "config.yaml")  # what the run wrote: --resume starts from it
    result = _invoke("finetune", "--output-dir", str(tmp_path), "--max-steps", "9", "--resume")
    assert result.exit_code == 3, result.output
    (resumed, resume, nproc) = calls[1]
    assert resumed == dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=9))
    assert resume is True and nproc is None


def test_finetune_user_error_raised_by_the_runner(monkeypatch):
    def broken(cfg, **kw):
        raise DataError("data.source 'x' holds no document; point it at some text")

    _fake_module(monkeypatch, "lctrain.train.runner", finetune=broken)
    result = _invoke("finetune")
    assert result.exit_code == 1 and result.stderr.strip() == (
        "error: data.source 'x' holds no document; point it at some text")


def test_backend_unavailable_is_a_user_error(monkeypatch):
    backends = pytest.importorskip("lctrain_kernels.backends")
    import lctrain.bench.kernel

    def run(**kw):
        raise backends.BackendUnavailable("backend 'flash_attn' is not installed; pip install flash-attn")

    monkeypatch.setattr(lctrain.bench.kernel, "run", run)
    result = _invoke("bench", "kernel", "--backend", "flash_attn")
    assert result.exit_code == 1 and "flash_attn" in result.stderr and "Traceback" not in result.output


def test_bench_kernel_runs_for_real_on_a_cpu(tmp_path):
    """No stand-in: the command line reaches the real bench (dtype given by name), says where it
    wrote its files, and prints every number of the result in the (piped) table."""
    pytest.importorskip("matplotlib")
    out, plot = tmp_path / "kernel.json", tmp_path / "k.png"
    result = _invoke("bench", "kernel", "--seq-len", "48,64", "--check-len", "32", "--backend",
                     "reference", "--heads", "2", "--head-dim", "16", "--dtype", "float32",
                     "--json", str(out), "--plot", str(plot))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["seq_len"] for r in rows] == [48, 64] and all(r["status"] == "ok" for r in rows)
    assert report["meta"]["check_len"] == 32 and report["meta"]["dtype"] == "float32"
    assert f"wrote the results to {out}" in result.stderr and f"wrote the plot to {plot}" in result.stderr
    assert plot.stat().st_size > 10_000
    assert "reference: error" in result.stderr  # progress goes to stderr, the table to stdout
    assert "reference" in result.stdout and "Traceback" not in result.output
    for line in ("fwd+bwd", "error", "status"):
        assert line in result.stdout


def test_every_row_failed_exits_nonzero_and_writes_no_plot(tmp_path):
    """On a CPU cudnn cannot run: the table and the JSON say why, the exit code says it failed,
    and no empty picture is left behind."""
    pytest.importorskip("matplotlib")
    out, plot = tmp_path / "r.json", tmp_path / "k.png"
    result = _invoke("bench", "kernel", "--backend", "cudnn", "--seq-len", "64", "--heads", "2",
                     "--head-dim", "8", "--json", str(out), "--plot", str(plot))
    if "status" in result.stdout and result.exit_code == 0:
        pytest.skip("cudnn runs here (a GPU machine)")
    assert result.exit_code == 1 and "no measurement succeeded" in result.stderr
    assert "needs a CUDA GPU" in result.stdout  # the status note, in full
    assert json.loads(out.read_text())["rows"][0]["status"].startswith("the cudnn backend")
    assert not plot.exists()


def test_plot_problems_are_found_before_running(monkeypatch, tmp_path):
    calls = _record(monkeypatch, "kernel")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    result = _invoke("bench", "kernel", "--plot", str(tmp_path / "k.png"))
    assert result.exit_code == 1 and "needs matplotlib" in result.stderr and calls == []
    result = _invoke("bench", "kernel", "--plot", str(tmp_path / "k.txt"))
    assert result.exit_code == 1 and ".png" in result.stderr and calls == []


def test_bad_check_len_is_one_sentence(monkeypatch):
    _record(monkeypatch, "kernel")
    result = _invoke("bench", "kernel", "--check-len", "8q")
    assert result.exit_code != 0 and "--check-len" in result.stderr
    assert "Traceback" not in result.output


def test_bugs_keep_their_traceback(monkeypatch):
    import lctrain.bench.kernel

    def run(**kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(lctrain.bench.kernel, "run", run)
    result = _invoke("bench", "kernel")
    assert isinstance(result.exception, RuntimeError)


def test_bench_commands_parse_and_publish(monkeypatch, tmp_path):
    seen = {kind: _record(monkeypatch, kind) for kind in ("kernel", "attention", "step")}
    out = tmp_path / "k" / "r.json"
    result = _invoke("bench", "kernel", "--seq-len", "16k,32k", "--backend", "triton, flash",
                     "--heads", "8", "--head-dim", "64", "--dtype", "float16", "--json", str(out),
                     "--check-len", "8k", "--repeats", "7", "--warmup", "3", "--full")
    assert result.exit_code == 0, result.output
    kwargs = seen["kernel"][0][1]
    assert {k: v for k, v in kwargs.items() if k != "progress"} == dict(
        seq_lens=[16384, 32768], backends=["triton", "flash"], heads=8, kv_heads=None,
        head_dim=64, dtype="float16", causal=False, documents=None, recipe=None,
        dense_reference="auto", repeats=7, warmup=3, check_len=8192, profile_dir=None)
    assert json.loads(out.read_text())["kind"] == "kernel"
    result = _invoke("bench", "attention", "--seq-len", "64k", "--schedule", "distflash,ring",
                     "--nproc", "4", "--kv-heads", "8", "--overlap-ablation", "--repeats", "9",
                     "--warmup", "1", "--check-len", "4k", "--single-max-len", "128k",
                     "--min-time", "2", "--profile", str(tmp_path))
    assert result.exit_code == 0, result.output
    kwargs = seen["attention"][0][1]
    assert kwargs["seq_lens"] == [65536] and kwargs["schedules"] == ["distflash", "ring"]
    assert kwargs["nproc"] == 4 and kwargs["kv_heads"] == 8 and kwargs["overlap_ablation"] is True
    assert (kwargs["repeats"], kwargs["warmup"], kwargs["check_len"]) == (9, 1, 4096)
    assert (kwargs["single_max_len"], kwargs["min_time_s"]) == (131072, 2)
    assert kwargs["profile_dir"] == str(tmp_path) and kwargs["balance_documents"] is True
    result = _invoke("bench", "step", "llama-7b-64k", "--seq-len", "32k,64k", "--steps", "3",
                     "--warmup", "0", "--variant", "train.checkpointing=full",
                     "--variant", "train.checkpointing=remat parallel.schedule=zigzag",
                     "--documents", "lognormal:median=4k", "--memory-trace", "traces",
                     "--profile", "kernels")
    assert result.exit_code == 0, result.output
    (configs,), kwargs = seen["step"][0]
    assert [(label, c.data.seq_len, c.train.checkpointing, c.parallel.schedule)
            for label, c in configs] == [
        ("train.checkpointing=full", 32768, "full", "distflash"),
        ("train.checkpointing=remat parallel.schedule=zigzag", 32768, "remat", "zigzag"),
        ("train.checkpointing=full", 65536, "full", "distflash"),
        ("train.checkpointing=remat parallel.schedule=zigzag", 65536, "remat", "zigzag")]
    assert {k: v for k, v in kwargs.items() if k != "progress"} == {
        "steps": 3, "nproc": None, "warmup": 0, "save_every": 0,
        "documents": "lognormal:median=4k", "memory_trace": "traces",
        "profile": "kernels"}


def test_output_formats_on_stdout(monkeypatch):
    rows = [{"backend": "triton", "seq_len": 65536, "status": "ok", "fwd_tflops": 501.3,
             "bwd_tflops": 401.2, "total_tflops": 426.4, "max_rel_err": 0.0037}]
    _record(monkeypatch, "kernel", _result("kernel", rows))
    as_json = _invoke("bench", "kernel", "--format", "json")
    assert json.loads(as_json.stdout)["rows"] == rows
    as_csv = _invoke("bench", "kernel", "--format", "csv").stdout.splitlines()
    assert as_csv[0].startswith("backend,seq_len") and as_csv[1].startswith("triton,65536")
    markdown = _invoke("bench", "kernel", "--format", "markdown").stdout
    assert "| triton | 64K | 501 | 401 | 426 | 3.7e-03 | ok |" in markdown


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
                     "--gpu-memory", "80GiB", "--cp", "8", "--checkpointing", "full=4,remat=28",
                     "--host-memory", "1TiB", "--gpus-per-node", "4")
    assert result.exit_code == 0, result.output
    for text in ("activations", "64.0 GiB", "176K", "6.74 B", "NO"):
        assert text in result.stdout, text
    cfg, kwargs = calls[-1]
    assert cfg.data.seq_len == 524288 and cfg.parallel.cp == 8
    assert kwargs == dict(model=None, seq_len=524288, gpus=8, gpu_memory=80 * 2**30, cp=8,
                          checkpointing="full=4,remat=28", host_memory=2**40, gpus_per_node=4,
                          attended=1.0)  # rows of one document (no --documents)
    asked = []  # a hub name is first checked against the hub and its cache (offline here)
    monkeypatch.setattr("lctrain.cli.memory.check_hub_model",
                        lambda name, what: asked.append((name, what)))
    result = _invoke("estimate-memory", "--model", "meta-llama/Llama-2-7b-hf", "--seq-len", "64k",
                     "--gpu-memory", "80GB", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == payload
    assert asked == [("meta-llama/Llama-2-7b-hf", "--model")]
    assert calls[-1] == (None, dict(model="meta-llama/Llama-2-7b-hf", seq_len=65536, gpus=1,
                                    gpu_memory=80 * 10**9, cp=None, checkpointing=None,
                                    host_memory=None, gpus_per_node=None, attended=1.0))
    assert json.loads(_invoke("estimate-memory", "--format", "json").stdout) == payload
    assert calls[-1][1]["gpus"] == 2  # the tiny recipe's cp = 2: its own GPU count


def test_estimate_memory_with_the_real_memory_model():
    result = _invoke("estimate-memory", "llama-7b-64k", "--gpus", "8", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["per_gpu_bytes"]["total"] > 0
    plain = _invoke("estimate-memory")  # no arguments: the tiny recipe on its own 2 GPUs
    assert plain.exit_code == 0, plain.output
    assert "125,760" in plain.stdout and "0.00 B" not in plain.stdout  # its parameter count
    assert "fits" in plain.stdout and "yes" in plain.stdout
