"""``--resume`` of a run that has trained all its steps trains nothing and rewrites nothing: it
says so in one sentence with where the final model is, and writes ``final/`` only when the
recipe exports one and it is missing (one CPU process, tiny model)."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lctrain.cli import app

TINY = ("--nproc", 1, "--set", "parallel.cp=1", "--seq-len", 64, "--set", "data.max_documents=8",
        "--set", "train.warmup_steps=1", "--set", "parallel.attention_backend=reference")


def _cli(*args) -> tuple[int, str]:
    """The exit code and stdout of ``lctrain ARGS`` (stderr holds libraries' progress bars)."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback: a bug
    return result.exit_code, result.stdout


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time (ns)."""
    return {str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns)
            for f in sorted(folder.rglob("*")) if f.is_file() and ".launch" not in f.parts}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-step run that checkpointed step 2 and exported final/."""
    out = tmp_path_factory.mktemp("runs") / "run"
    code, output = _cli("finetune", *TINY, "--max-steps", 2, "--output-dir", out)
    assert code == 0, output
    assert (out / "final" / "config.json").is_file()
    return out


def test_resuming_a_finished_run_says_so_and_rewrites_nothing(run):
    before = _files(run)
    start = time.monotonic()
    code, output = _cli("finetune", "--output-dir", run, "--resume")
    assert code == 0, output
    assert time.monotonic() - start < 5  # no process started, no weight loaded
    assert output.splitlines() == [
        f"the run in {run} has already trained step 2 of 2, so nothing was trained; its final "
        f"model is {run / 'final'} (raise train.max_steps (--max-steps) to train further)."]
    assert _files(run) == before  # final/, metrics, checkpoints and config.yaml untouched


def test_a_finished_run_without_final_writes_it_when_the_recipe_exports_one(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "final")
    code, output = _cli("finetune", "--output-dir", copy, "--resume",
                        "--set", "checkpoint.export_final=false")
    assert code == 0, output
    assert output.splitlines() == [
        f"the run in {copy} has already trained step 2 of 2, so nothing was trained; its final "
        f"model {copy / 'final'} is missing (checkpoint.export_final is false): lctrain export "
        f"{copy} --output DIR writes one from {copy / 'checkpoints' / 'step-00000002'}."]
    assert not (copy / "final").exists()
    metrics = (copy / "metrics.jsonl").read_text()
    code, output = _cli("finetune", "--output-dir", copy, "--resume")
    assert code == 0, output
    lines = output.splitlines()
    assert lines[0] == (f"the run in {copy} has already trained step 2 of 2, so nothing was "
                        f"trained; its final model {copy / 'final'} is missing, so it is written "
                        "now.")
    assert lines[1].startswith(f"exported the full weights of step 2 to {copy / 'final'}")
    assert (copy / "final" / "config.json").is_file() and len(lines) == 2
    assert (copy / "metrics.jsonl").read_text() == metrics
    stale = _files(copy / "final")  # now current: a further resume leaves it be
    assert _cli("finetune", "--output-dir", copy, "--resume")[0] == 0
    assert _files(copy / "final") == stale


def test_a_run_by_epochs_is_finished_once_its_data_says_so(tmp_path):
    out = tmp_path / "epochs"
    code, output = _cli("finetune", *TINY, "--set", "train.max_steps=null",
                        "--set", "train.epochs=0.004", "--set", "checkpoint.export_final=false",
                        "--output-dir", out)
    assert code == 0, output
    steps = len((out / "metrics.jsonl").read_text().splitlines())
    assert 1 < steps < 5, output
    before = _files(out / "checkpoints")
    code, output = _cli("finetune", "--output-dir", out, "--resume")
    assert code == 0, output
    assert f"has already trained step {steps} of {steps}, so nothing was trained" in output
    assert "lctrain finetune:" not in output  # no banner: no model was built
    assert len((out / "metrics.jsonl").read_text().splitlines()) == steps
    assert _files(out / "checkpoints") == before
