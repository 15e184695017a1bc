"""`lctrain report` on runs the test makes, what a run records about its machine, and
`lctrain bench step` over several configurations (real training, one CPU process)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe

SMALL = {"data.seq_len": 128, "data.max_documents": 16, "train.warmup_steps": 1,
         "train.loss_chunk_tokens": 48, "parallel.attention_backend": "reference",
         "parallel.cp": 1, "checkpoint.keep": 0}


def _overrides(**extra) -> list[str]:
    return [f"{k}={v}" for k, v in {**SMALL, **extra}.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two short real runs that differ in learning rate and length, with their banners."""
    from lctrain.train.runner import finetune

    root = tmp_path_factory.mktemp("runs")
    made = []
    for name, extra in (("a", {"train.lr": 3e-3}), ("b", {"train.lr": 1e-3, "train.max_steps": 2})):
        cfg = load_recipe(None, _overrides(**{"train.max_steps": 3, **extra}),
                          output_dir=str(root / name))
        assert finetune(cfg, nproc=1) == 0
        made.append(root / name)
    return made


def _records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_run_writes_its_environment(runs):
    import torch

    env = json.loads((runs[0] / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["lctrain"] and env["python"]
    assert env["gpus"] == torch.cuda.device_count()


def test_report_summarises_runs_and_their_differences(runs, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "loss.png"
    result = CliRunner().invoke(app, ["report", str(runs[0]), str(runs[1]), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("run "))
    assert "train.lr" in lines[head] and "train.max_steps" in lines[head]  # whole keys
    assert "seq_len" not in lines[head] and "step time" in lines[head]
    assert "step time = the sum of the logged steps' times, not the wall clock" in result.stdout
    rows = {line.split()[0]: line.split() for line in lines[head + 3:head + 5]}
    for folder in runs:
        recs = _records(folder)
        cells = rows[folder.name]
        assert str(recs[-1]["step"]) in cells  # steps
        assert f"{recs[-1]['loss']:.4f}" in cells  # final loss, 4 decimals
        assert f"{min(r['loss'] for r in recs):.4f}" in cells  # best loss
    assert "train.lr: a 0.003 | b 0.001" in result.stdout
    assert plot.stat().st_size > 10_000 and "wrote the plot to" in result.stderr
    as_json = json.loads(CliRunner().invoke(app, ["report", *map(str, runs), "--format", "json"]).stdout)
    assert [r["run"] for r in as_json] == ["a", "b"] and as_json[1]["steps"] == 2
    assert as_json[0]["train.lr"] == "0.003" and as_json[0]["tokens_per_s"] > 0


def test_a_run_whose_last_step_was_skipped_has_no_final_loss(runs, tmp_path):
    import shutil

    run = shutil.copytree(runs[0], tmp_path / "nan")
    recs = _records(run)
    skipped = {**recs[-1], "step": recs[-1]["step"] + 1, "loss": None, "skipped_steps": 1}
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(skipped) + "\n")
    result = CliRunner().invoke(app, ["report", str(run), "--format", "json"])
    (row,) = json.loads(result.stdout)
    assert row["steps"] == skipped["step"] and row["loss_final"] is None
    assert row["loss_best"] == min(r["loss"] for r in recs)
    text = CliRunner().invoke(app, ["report", str(run)]).stdout
    assert "nan: the last step's loss was not finite (its update skipped), so final is blank" \
        in text


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1 and "config.yaml does not exist" in result.stderr
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").mkdir()
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1
    assert f"{tmp_path / 'metrics.jsonl'} is a folder, not a file" in result.stderr


@pytest.mark.parametrize("metrics, config, words", [
    ('{"step": 1, "loss": 5.0}\n{"step": 2, "lo', "train: {}\n", "metrics.jsonl:2 is not valid JSON"),
    ('{"step": 1}\n[1, 2]\n', "train: {}\n", "metrics.jsonl:2 is not a JSON object"),
    (b'{"step": 1}\n\xff\n', "train: {}\n", "metrics.jsonl is not UTF-8"),
    ('{"step": 1}\n', "model: [unclosed\n", "config.yaml is not valid YAML at line 2"),
    ('{"step": 1}\n', "", "config.yaml holds nothing"),
    ('{"step": 1}\n', "- a\n", "config.yaml holds no mapping"),
])
def test_report_names_the_damaged_file_of_a_run(tmp_path, metrics, config, words):
    """A half-written or damaged run file: one sentence naming it (and its line), no table."""
    write = lambda p, v: p.write_bytes(v) if isinstance(v, bytes) else p.write_text(v)
    write(tmp_path / "metrics.jsonl", metrics)
    write(tmp_path / "config.yaml", config)
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and words in lines[0], result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output


def test_bench_step_times_each_configuration_and_reports_the_one_that_fails(tmp_path):
    from lctrain.bench.step import configurations, run

    out, model = tmp_path / "out", tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')  # no sizes: cannot run
    base = _overrides(**{"train.output_dir": str(out)})
    configs = configurations(None, base, [128], ["train.checkpointing=full",
                                                 f"model.path={model} model.config=null "
                                                 "data.tokenizer=null"])
    lines = []
    result = run(configs, steps=1, nproc=1, warmup=1, progress=lines.append)
    ok, failed = result.rows
    assert ok["variant"] == "train.checkpointing=full" and ok["status"] == "ok"
    assert ok["policy"] == "full" and ok["steps"] == 1 and ok["tokens_per_s"] > 0
    assert ok["seq_len"] == 128 and ok["attn_fwd_expected"] == 2 * 2  # 2 layers, full: twice
    assert failed["status"] != "ok" and str(model) in failed["status"], failed
    assert len(lines) == 4 and lines[1].startswith("configuration 1/2: 128 tokens")
    assert not out.exists()  # scratch folders, and the folder made for them, are removed


def test_the_banner_names_versions_and_one_time_costs(tmp_path):
    from lctrain.report.versions import one_time_costs, record_run

    text = record_run(tmp_path / "run", "cpu", "auto")
    assert text.startswith("lctrain ") and "torch " in text and "first step" not in text
    env = json.loads((tmp_path / "run" / "environment.json").read_text())
    assert "nvidia-cudnn-frontend" in env and env["cudnn"] is None  # no GPU here
    costs = one_time_costs("cuda", "triton")
    assert any("autotuning attention kernels for this shape — first step only" in c for c in costs)
    assert not any("autotuning" in c for c in one_time_costs("cuda", "cudnn"))
    assert not any("autotuning" in c for c in one_time_costs("cuda", "auto"))  # dense: cudnn
    assert any("cuDNN plans for document-masked" in c
               for c in one_time_costs("cuda", "cudnn_ragged", document_mask=True))
    named = one_time_costs("cuda", "flash_attn_cute", document_mask=True)
    assert any("compiling FlashAttention 4's kernels" in c for c in named)
    assert not any("autotuning" in c or "cuDNN plans" in c for c in named)


def test_the_recorded_commit_is_the_checkout_s_or_the_one_named(monkeypatch):
    """Results name the code that ran: the checkout's commit (``+changes`` when its files
    differ), or ``LCTRAIN_COMMIT`` where the code was copied to a machine whose git folder
    cannot say."""
    import subprocess

    from lctrain.report.versions import environment

    monkeypatch.delenv("LCTRAIN_COMMIT", raising=False)
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                          text=True).stdout.strip()
    recorded = environment()["lctrain_commit"]
    assert recorded in (head or None, f"{head}+changes")
    monkeypatch.setenv("LCTRAIN_COMMIT", "abc1234")
    assert environment()["lctrain_commit"] == "abc1234"
