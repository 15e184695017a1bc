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
    assert "\n## Measured\n" in README


class _Result:
    def table(self):
        from rich.table import Table

        return Table("result")

    def to_json(self):
        return {"rows": []}

    def plot(self, path):
        Path(path).write_text("png")


def _stand_ins(monkeypatch) -> list[tuple[str, tuple, dict]]:
    calls: list[tuple[str, tuple, dict]] = []

    def recorder(name, result):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result
        return call

    memory = types.SimpleNamespace(to_json=lambda: {"per_gpu_bytes": {"total": 1}, "fits": True})
    exported = types.SimpleNamespace(kind="full", step=1, dtype="float32", output="out",
                                     files=("config.json",), base=None)
    for module, attr, result in [("lctrain.train.runner", "finetune", 0),
                                 ("lctrain.memory", "estimate_recipe", memory),
                                 ("lctrain.export", "export_run", exported),
                                 ("lctrain.bench.kernel", "run", _Result()),
                                 ("lctrain.bench.attention", "run", _Result()),
                                 ("lctrain.bench.step", "run", _Result())]:
        fake = types.ModuleType(module)
        setattr(fake, attr, recorder(module, result))
        monkeypatch.setitem(sys.modules, module, fake)
    return calls


EXAMPLES = [line for line in _code_lines()
            if line.startswith("lctrain ") and "[" not in line and "model.path=" not in line]


def test_the_readme_has_examples_of_every_command():
    for command in ("finetune", "estimate-memory", "bench kernel", "bench attention", "bench step",
                    "export"):
        assert any(line.startswith(f"lctrain {command}") for line in EXAMPLES), command


@pytest.mark.parametrize("line", EXAMPLES)
def test_readme_example_runs(line, monkeypatch, tmp_path):
    calls = _stand_ins(monkeypatch)
    monkeypatch.chdir(tmp_path)  # outputs land here; recipes/x.yaml resolves to the shipped one
    result = CliRunner().invoke(app, shlex.split(line)[1:])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1
