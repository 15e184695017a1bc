"""`lctrain bench step` on a CPU at tiny size: real training steps through the runner, with the
attention forwards per step counted under each checkpointing policy."""
import json
from pathlib import Path

import pytest

from lctrain.bench.step import run
from lctrain.config import load_recipe


@pytest.mark.parametrize("policy, per_layer", [("remat", 1), ("full", 2)])
def test_bench_step_runs_and_counts_attention(tmp_path, policy, per_layer):
    cfg = load_recipe(None, ["parallel.cp=1", f"train.checkpointing={policy}",
                             "data.max_documents=40", f"train.output_dir={tmp_path / 'run'}"],
                      seq_len=128)
    result = run(cfg, steps=2, nproc=1)
    (row,) = result.rows
    layers = cfg.model.config["num_hidden_layers"]
    assert row["steps"] == 2 and row["policy"] == policy
    assert row["attn_fwd_per_step"] == row["attn_fwd_expected"] == per_layer * layers
    assert row["tokens_per_s"] > 0 and row["step_time_s"] > 0
    assert len(row["step_times_s"]) == 2 and row["step_time_s"] == pytest.approx(
        sum(row["step_times_s"]) / 2)  # the median of two is their mean
    assert row["peak_gib"] > 0 and row["model_peak_gib"] > 0
    assert row["mfu"] is None and row["peak_vs_model"] is None  # no GPU here
    assert row["alloc_retries"] is None and row["reserved_gib"] is None  # CUDA's allocator only
    assert all(0 < row[k] < 10 for k in ("loss_first", "loss_last"))  # ln(260) ≈ 5.6 at start
    data = json.loads(result.to_json())
    assert data["rows"][0]["attn_fwd_per_step"] == per_layer * layers
    assert not (tmp_path / "run").exists()  # the scratch run and the folder it made are gone
    from lctrain.bench.views import table

    notes = " ".join(table(result).notes)
    assert "on a CPU, peak is the process's largest resident memory" in notes


def test_a_failed_training_run_is_a_row_status_not_a_traceback(tmp_path, monkeypatch):
    import lctrain.train.runner as runner

    def died(cfg, nproc, own_process):  # the workers died (e.g. out of memory) and said why
        launch = Path(cfg.train.output_dir) / ".launch"
        launch.mkdir(parents=True)
        (launch / "workers.log").write_text("rank 0: CUDA out of memory\n")
        return 1

    monkeypatch.setattr(runner, "finetune", died)
    cfg = load_recipe(None, ["parallel.cp=1", f"train.output_dir={tmp_path / 'run'}"], seq_len=128)
    (row,) = run(cfg, steps=1, nproc=1).rows
    (kept,) = (tmp_path / "run").iterdir()  # the scratch run is gone, its log kept
    assert f"failed with exit code 1; its workers' log, kept at {kept}, says why" in row["status"]
    assert kept.read_text() == "rank 0: CUDA out of memory\n"


def test_bench_step_profiles_the_last_step(tmp_path):
    cfg = load_recipe(None, ["parallel.cp=1", "data.max_documents=40",
                             f"train.output_dir={tmp_path / 'run'}"], seq_len=128)
    (row,) = run(cfg, steps=1, warmup=1, nproc=1, profile=str(tmp_path / "prof")).rows
    folder = tmp_path / "prof" / "1"
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank0-step2-kernels.json", "rank0-step2-kernels.txt", "rank0-step2.json"]
    assert json.loads((folder / "rank0-step2.json").read_text())["traceEvents"]
    summary = json.loads((folder / "rank0-step2-kernels.json").read_text())
    cats = summary["categories_ms"]
    assert set(cats) == {"attention", "matmul", "communication", "copies", "other"}
    assert cats["matmul"] > 0 and cats["attention"] > 0  # the projections and cpu_flash
    assert {k["category"] for k in summary["top"]} >= {"matmul", "attention"}
    assert row["profile_wall_ms"] == summary["wall_ms"] > 0
    assert row["profile_matmul_ms"] == cats["matmul"]
    assert "device time by category" in (folder / "rank0-step2-kernels.txt").read_text()


def test_a_rows_allocator_retries_are_those_of_its_timed_steps():
    """GPU runs log the caching allocator's retries so far; a row counts the timed steps' own."""
    from lctrain.bench.step import _timed_retries

    records = [{"step": s, "alloc_retries": n} for s, n in enumerate((0, 3, 3, 7), 1)]
    assert _timed_retries(records, 2) == 4  # two warm-up steps
    assert _timed_retries(records, 0) == 7  # none
    assert _timed_retries([{"step": 1, "alloc_retries": 3}], 1) == 3  # only a warm-up step:
    # the row reports it, as it does its time
    assert _timed_retries([{"step": 1}], 0) is None  # a CPU run logs none
