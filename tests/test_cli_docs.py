"""The README stays true: its quickstart matches CI, and its lctrain examples parse and run
(against recording stand-ins for the training, memory and bench libraries)."""
from __future__ import annotations

import re
import shlex
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lctrain.cli import app

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _code_lines() -> list[str]:
    """Every shell line of the README's bash blocks, backslash continuations joined."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def test_quickstart_opens_the_readme_and_matches_ci():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert commands == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . "
        "&& lctrain finetune", ci]
    assert README.index(first_block) < README.index("## ")
    assert "\n## Performance\n" in README


def _result(kind: str):
    from lctrain.bench.result import BenchResult

    row = {"seq_len": 1024, "status": "ok", "total_tflops": 1.0, "backend": "x", "variant": "x",
           "step_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1}
    return BenchResult(kind=kind, title=kind, rows=[row])


def _eval_result(task: str):
    from lctrain.eval.result import EvalResult

    rows = ([{"bucket": "0–4K", "start": 0, "stop": 4096, "tokens": 9, "loss": 2.0, "ppl": 7.4},
             {"bucket": "all", "start": 0, "stop": 4096, "tokens": 9, "loss": 2.0, "ppl": 7.4}]
            if task == "ppl" else
            [{"seq_len": 1024, "depth": 0.5, "needle_position": 500, "accuracy": 1.0,
              "correct": 1, "trials": 1, "passkey": "12345", "answer": "12345."}])
    return EvalResult(task=task, title=task, rows=rows, meta={"seq_len": 4096})


def _stand_ins(monkeypatch) -> list[tuple[str, tuple, dict]]:
    """Record the library calls; the bench's result is a real (tiny) BenchResult, so the
    output path (table, JSON, plot) runs for real."""
    import lctrain.bench.attention
    import lctrain.bench.kernel
    import lctrain.bench.step

    calls: list[tuple[str, tuple, dict]] = []

    def recorder(name, result):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result
        return call

    memory = types.SimpleNamespace(to_json=lambda: {"per_gpu_bytes": {"total": 1}, "fits": True})
    plan = {"model": "m", "machine": {"gpus": 1, "gpu_memory": 1, "host_memory": None,
                                      "gpus_per_node": 1}, "seq_len": None, "longest": None,
            "fastest": None}
    exported = types.SimpleNamespace(kind="full", step=1, dtype="float32", output="out",
                                     files=("config.json",), base=None)
    for module, attrs in [("lctrain.train.runner", {"finetune": 0}),
                          ("lctrain.memory", {"estimate_recipe": memory, "plan_recipe": plan}),
                          ("lctrain.export", {"export_run": exported})]:
        fake = types.ModuleType(module)
        for attr, result in attrs.items():
            setattr(fake, attr, recorder(module, result))
        monkeypatch.setitem(sys.modules, module, fake)
    import lctrain.bench.tiles
    import lctrain.eval.request

    monkeypatch.setattr(lctrain.eval.request, "resolve",  # the target need not exist here
                        lambda target, *, task, **_: (None, types.SimpleNamespace(task=task)))
    fake = types.ModuleType("lctrain.eval.run")
    fake.evaluate = lambda cfg, request, **kw: recorder("lctrain.eval.run", _eval_result(
        request.task))(cfg, request, **kw)
    monkeypatch.setitem(sys.modules, "lctrain.eval.run", fake)
    for module, kind in [(lctrain.bench.kernel, "kernel"), (lctrain.bench.attention, "attention"),
                         (lctrain.bench.step, "step"), (lctrain.bench.tiles, "tiles")]:
        monkeypatch.setattr(module, "run", recorder(module.__name__, _result(kind)))
    return calls


EXAMPLES = [line for line in _code_lines()
            if line.startswith("lctrain ") and "[" not in line and "model.path=" not in line]


def test_the_readme_has_examples_of_every_command():
    for command in ("finetune", "estimate-memory", "bench kernel", "bench attention", "bench step",
                    "bench tiles", "bench report", "export", "eval"):
        assert any(line.startswith(f"lctrain {command}") for line in EXAMPLES), command


@pytest.mark.parametrize("line", EXAMPLES)
def test_readme_example_runs(line, monkeypatch, tmp_path):
    calls = _stand_ins(monkeypatch)
    monkeypatch.chdir(tmp_path)  # outputs land here; recipes/x.yaml resolves to the shipped one
    args = shlex.split(line)[1:]
    reads_files = args[:2] == ["bench", "report"]
    if reads_files:  # the result files it reads, as a bench would have written them
        for name in (a for a in args[2:] if a.endswith(".json")):
            _result("attention").save(tmp_path / name)
    if "--resume" in args:  # the run it continues, as `lctrain finetune` left it
        from lctrain.config import load_recipe, save_resolved

        out = args[args.index("--output-dir") + 1]
        save_resolved(load_recipe(None, output_dir=out), tmp_path / out / "config.yaml")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert len(calls) == (0 if reads_files or args == ["--version"] else 1)


PERFORMANCE = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "docs" / "performance").glob("*.json")))
def test_published_tables_are_printed_from_their_result_files(name):
    """Every result file's summary, as `lctrain bench report FILE --format markdown` prints it,
    is the table published beside its name (the README repeats some; each row verbatim)."""
    result = CliRunner().invoke(app, ["bench", "report", str(REPO / "docs" / "performance" / name),
                                      "--format", "markdown"])
    assert result.exit_code == 0, result.output
    body = [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]
    assert body and name in PERFORMANCE
    for line in body:
        assert line in PERFORMANCE, line
    if any(line in README for line in body):
        assert all(line in README for line in body), name
