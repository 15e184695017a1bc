"""Resume exactness where the step count alone does not say where the run stands: a run whose
updates were skipped (non-finite loss) has a learning-rate schedule behind its step count, and a
resumed run must go on from the schedule's position, not from the step's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.checkpoint.reader import list_checkpoints

SETS = ["--nproc", "1", "--set", "parallel.cp=1", "--seq-len", "64",
        "--set", "data.max_documents=8", "--set", "checkpoint.every=1",
        "--set", "checkpoint.keep=10", "--set", "checkpoint.export_final=false",
        "--set", "train.warmup_steps=4", "--set", "train.lr=1e10",
        "--set", "train.max_nonfinite_steps=50"]


def _records(folder: Path) -> dict[int, dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def test_a_run_resumed_after_skipped_steps_keeps_its_learning_rates(tmp_path):
    """lr = 1e10: step 1 trains, steps 2-5 are non-finite and skipped, so the warm-up stays at
    step 1's next rate. Resumed from step 3's checkpoint, steps 4 and 5 must log the rates of
    the run left alone (the schedule wound back for the skipped steps), not rates two steps on."""
    alone, resumed = tmp_path / "alone", tmp_path / "resumed"
    result = CliRunner().invoke(app, ["finetune", *SETS, "--max-steps", "5",
                                      "--output-dir", str(alone)])
    assert result.exit_code == 0, result.output
    straight = _records(alone)
    assert [s for s in straight if straight[s].get("skipped_steps")] == [2, 3, 4, 5]
    shutil.copytree(alone, resumed, ignore=shutil.ignore_patterns(".launch"))
    for step, path in list_checkpoints(resumed / "checkpoints"):
        if step > 3:
            shutil.rmtree(path)  # as if the run had been stopped after step 3's save
    result = CliRunner().invoke(app, ["finetune", *SETS, "--max-steps", "5",
                                      "--output-dir", str(resumed), "--resume"])
    assert result.exit_code == 0, result.output
    after = _records(resumed)
    assert sorted(after) == [1, 2, 3, 4, 5]
    for step in (4, 5):
        assert after[step]["lr"] == straight[step]["lr"] == straight[2]["lr"], step


def test_a_streak_of_skipped_steps_goes_on_across_a_resume(tmp_path):
    """train.max_nonfinite_steps = 3: steps 2 and 3 are skipped and the run ends at step 3
    (a streak of two). Resumed for three more steps, step 4 is the third in a row and ends the
    run, as it would have without the stop; the resume must not start the count afresh."""
    out = tmp_path / "run"
    sets = [*SETS, "--set", "train.max_nonfinite_steps=3", "--output-dir", str(out)]
    result = CliRunner().invoke(app, ["finetune", *sets, "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["finetune", *sets, "--max-steps", "6", "--resume"])
    assert result.exit_code == 1, result.output
    assert "3 steps in a row up to step 4 had a non-finite loss" in " ".join(
        result.output.split()), result.output
    assert sorted(_records(out)) == [1, 2, 3, 4]
