"""`lctrain report` lists differences in the lora settings only where some run has LoRA on."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe, save_resolved


def _run(root: Path, name: str, lr: float, lora: dict | None) -> str:
    """A run folder as finetune leaves it (resolved config.yaml, metrics.jsonl), its lora
    section replaced by ``lora`` (None: no lora section, as a recipe from before LoRA)."""
    folder = root / name
    save_resolved(load_recipe(None, [f"train.lr={lr}"], output_dir=str(folder)),
                  folder / "config.yaml")
    settings = yaml.safe_load((folder / "config.yaml").read_text())
    if lora is None:
        del settings["lora"]
    else:
        settings["lora"].update(lora)
    (folder / "config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    return str(folder)


def _report(*folders: str) -> tuple[str, list[dict]]:
    text = CliRunner().invoke(app, ["report", *folders])
    assert text.exit_code == 0, text.output
    rows = CliRunner().invoke(app, ["report", *folders, "--format", "json"])
    assert rows.exit_code == 0, rows.output
    return text.stdout, json.loads(rows.stdout)


def test_lora_settings_are_left_out_when_no_run_has_lora_on(tmp_path):
    runs = [_run(tmp_path, "old", 1e-3, None),  # no lora section at all
            _run(tmp_path, "plain", 2e-3, {}),  # rank 0, the defaults
            _run(tmp_path, "edited", 3e-3, {"dropout": 0.1, "target_modules": ["q_proj"]})]
    text, rows = _report(*runs)
    assert "train.lr: old 0.001 | plain 0.002 | edited 0.003" in text
    assert "lora" not in text
    assert [sorted(k for k in row if "." in k) for row in rows] == [["train.lr"]] * 3


def test_lora_settings_are_listed_when_a_run_has_lora_on(tmp_path):
    runs = [_run(tmp_path, "full", 1e-3, {}),
            _run(tmp_path, "adapters", 1e-3, {"rank": 8, "target_modules": ["q_proj"]})]
    text, rows = _report(*runs)
    assert "lora.rank: full 0 | adapters 8" in text
    assert 'lora.target_modules: full ["all-linear"] | adapters ["q_proj"]' in text
    assert rows[1]["lora.rank"] == "8" and "train.lr" not in rows[1]
