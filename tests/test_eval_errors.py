"""``lctrain eval`` targets and data a user gets wrong, or that the run would get wrong:

- a TARGET that does not exist says what TARGET may be (not only "recipe file");
- an adapter folder whose base model is missing or gone is named as such, with
  the two ways to evaluate it;
- ``--data`` is read in its own format (detected from its records), not in the target's
  data.format: a recipe that trains on chat evaluates a plain-text file; ``--set data.format``
  still names one.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe, save_resolved

runner = CliRunner()


def _error(*args) -> str:
    """The one-sentence error of ``lctrain eval ARGS`` (exit 1, no traceback), unwrapped."""
    result = runner.invoke(app, ["eval", *map(str, args)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


def test_missing_target_says_what_target_may_be(tmp_path):
    message = _error(tmp_path / "nothere", "--task", "ppl")
    assert message.startswith(f"error: TARGET {tmp_path / 'nothere'} does not exist; give a run "
                              "folder, one of its checkpoints (RUN/checkpoints/step-N), a model "
                              "folder (config.json), a recipe file or a shipped recipe (")
    assert "tiny" in message
    assert "recipe file" not in _error("runs/nothere", "--task", "ppl").split(";")[0]


def test_lora_adapter_export_is_named(tmp_path):
    adapter = tmp_path / "lora_adapter"  # what lctrain export writes for a LoRA run
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    (adapter / "tokenizer.json").write_text("{}")
    assert _error(adapter) == (f"error: {adapter} holds a LoRA adapter that names no base model "
                               "(base_model_name_or_path); evaluate the run folder, or export it "
                               "with --merge and evaluate that")
    config = {"peft_type": "LORA", "r": 4, "base_model_name_or_path": str(tmp_path / "gone")}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert _error(adapter) == (f"error: {adapter} holds a LoRA adapter whose base model "
                               f"{tmp_path / 'gone'} is gone; evaluate the run folder, or export "
                               "it with --merge and evaluate that")
    (adapter / "adapter_config.json").unlink()  # a folder of neither kind still says so
    assert "neither config.yaml (a run folder) nor config.json" in _error(adapter)


def _chat_recipe_and_text(tmp_path: Path) -> tuple[Path, Path]:
    recipe = tmp_path / "chat.yaml"
    save_resolved(load_recipe(None, ["data.format=chat", "data.seq_len=128", "parallel.cp=1"],
                              output_dir=str(tmp_path / "run")), recipe)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"plain text, document {i}. " * 12}) + "\n"
                            for i in range(4)))
    return recipe, text


def test_data_is_read_in_its_own_format(tmp_path):
    from lctrain.eval.request import resolve

    recipe, text = _chat_recipe_and_text(tmp_path)
    assert load_recipe(recipe).data.format == "chat"
    cfg, _ = resolve(str(recipe), task="ppl", data=str(text))
    assert (cfg.data.format, cfg.data.source) == ("auto", str(text))
    cfg, _ = resolve(str(recipe), task="ppl")  # the recipe's own data keeps its format
    assert cfg.data.format == "chat"
    cfg, _ = resolve(str(recipe), task="ppl", data=str(text), overrides=["data.format=text"])
    assert cfg.data.format == "text"

    result = runner.invoke(app, ["eval", str(recipe), "--task", "ppl", "--data", str(text),
                                 "--max-rows", "1", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    # named explicitly, the chat format is applied to the text file, and refused in a sentence
    assert f"{text}:1: messages must be a list" in _error(
        recipe, "--task", "ppl", "--data", text, "--max-rows", 1, "--set", "data.format=chat")


def test_a_failed_rank_keeps_its_log(tmp_path, monkeypatch):
    """A rank that dies mid-evaluation: the scratch folder goes, the ranks' log is kept and
    named."""
    from lctrain.errors import UserError
    from lctrain.eval import evaluate as eval_run
    from lctrain.eval.request import resolve

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def died(cfg, worker, **kw):
        launch = Path(cfg.train.output_dir) / ".launch"
        launch.mkdir(parents=True)
        (launch / "workers.log").write_text("rank 1: killed\n")
        raise UserError("rank 1 (pid 7) was ended by SIGTERM; nothing was kept.")  # no ".;"

    monkeypatch.setattr(eval_run.launcher, "dispatch", died)
    cfg, request = resolve("tiny", task="ppl")
    with pytest.raises(UserError) as caught:
        eval_run.evaluate(cfg, request, nproc=1)
    (kept,) = tmp_path.glob("lctrain-eval-*-workers.log")
    assert str(caught.value) == ("rank 1 (pid 7) was ended by SIGTERM; nothing was kept; the "
                                 f"ranks' log is kept at {kept}")
    assert kept.read_text() == "rank 1: killed\n"
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []


def test_bench_report_of_an_eval_result_checks_its_files_first(tmp_path):
    """``lctrain bench report`` of an eval result: a --plot file type matplotlib cannot write,
    and a FILE that is missing, are one sentence each, before any table."""
    from lctrain.eval.result import EvalResult

    doc = EvalResult(task="ppl", title="t", meta={"seq_len": 64}, rows=[
        {"bucket": "0–64", "start": 0, "stop": 64, "tokens": 9, "loss": 2.0, "ppl": 7.39},
        {"bucket": "all", "start": 0, "stop": 64, "tokens": 9, "loss": 2.0, "ppl": 7.39}])
    done = doc.save(tmp_path / "ppl.json")
    for args, words in (([done, "--plot", tmp_path / "p.txt"], "the file name must end in one of"),
                        ([done, tmp_path / "gone.json"], f"cannot read {tmp_path / 'gone.json'}")):
        result = runner.invoke(app, ["bench", "report", *map(str, args)])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert result.stdout == "" and words in result.stderr, result.output
