"""``lctrain estimate-memory --model PATH``: a local path is read as what it is, never looked up
on the hub, and its faults are the sentences finetune gives for the same model folder."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe
from lctrain.errors import ConfigError
from lctrain.memory.presets import PRESETS

BROKEN = '{"model_type": "llama",\n  hidden_size: 64}\n'
"""A config.json whose line 2 is not JSON (an unquoted key)."""


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if anything asks the hub (transformers' AutoConfig) for a config."""
    from transformers import AutoConfig

    def refuse(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args[0]!r}")

    monkeypatch.setattr(AutoConfig, "from_pretrained", refuse)


def _estimate(model: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["estimate-memory", "--model", model, "--seq-len", "512"])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback, or the hub was asked
    return result.exit_code, result.output


def test_a_damaged_config_json_is_reported_as_finetune_reports_it(tmp_path, no_hub):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text(BROKEN)
    fault = (f"{folder / 'config.json'}:2 is not valid JSON (Expecting property name enclosed in "
             f"double quotes at column 3)")
    code, output = _estimate(str(folder))
    assert code == 1 and output.strip() == f"error: {fault}; the model folder is damaged", output
    with pytest.raises(ConfigError) as info:  # finetune's sentence, by the same reader
        load_recipe(None, [f"model.path={folder}", "model.config=null", "data.tokenizer=null"])
    assert str(info.value).startswith(f"{fault}; the model folder is damaged")
    code, output = _estimate(str(folder / "config.json"))
    assert code == 1 and output.strip() == f"error: {fault}; fix the file", output
    (folder / "config.json").write_bytes(b'{"model_type": "caf\xe9"}')
    code, output = _estimate(str(folder))
    assert code == 1 and output.strip() == (f"error: {folder / 'config.json'} is not UTF-8 text; "
                                            f"the model folder is damaged"), output


def test_a_local_folder_without_a_usable_config_is_named(tmp_path, no_hub):
    code, output = _estimate(str(tmp_path))
    assert code == 1 and output.strip() == (
        f"error: model {str(tmp_path)!r} is a folder without a config.json; point it at a model "
        f"folder (config.json, weights, tokenizer) or a config.json file"), output
    (tmp_path / "config.json").write_text("[1, 2]")
    code, output = _estimate(str(tmp_path))
    assert code == 1 and output.strip() == (f"error: the model config {tmp_path / 'config.json'} "
                                            f"is not a JSON object; the model folder is damaged")


def test_a_good_local_folder_and_a_preset_are_estimated_without_the_hub(tmp_path, no_hub):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama3-8b"]))
    for model in (str(tmp_path), "llama3-8b"):
        code, output = _estimate(model)
        assert code == 0 and "Estimated memory per GPU" in output, output
