"""``estimate-memory --model`` assumes what one would run at the length and says so; the commands
``--plan`` prints load as printed and give the planned settings (and the planned memory)."""
from __future__ import annotations

import json
import random
import re
import shlex

import pytest
import torch
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe
from lctrain.memory import estimate_recipe, load_architecture
from lctrain.memory.presets import PRESETS

GIB = 1 << 30
runner = CliRunner()


def _rows(table: str) -> dict[str, str]:
    return {parts[0]: parts[-1] for parts in (re.split(r"\s{2,}", line.strip())
                                              for line in table.splitlines())}


def _invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_a_bare_model_at_512k_on_8_gpus_fits_and_names_its_assumptions():
    table = _invoke("estimate-memory", "--model", "llama-7b", "--gpus", "8", "--seq-len", "512k")
    rows = _rows(table)
    assert rows["fits"] == "yes", table
    cp = int(rows["cp"])
    assert f"assumed cp {cp}: the smallest that fits 512k tokens on 8 GPUs (--cp to choose)" \
        in table and "assumed checkpointing auto" in table, table
    # the reference: the memory model itself, by cp, with checkpointing auto
    fits = {c: estimate_recipe(None, model="llama-7b", seq_len=512 << 10, gpus=8,
                               gpu_memory=80 * GIB, cp=c, checkpointing="auto").fits
            for c in (1, 2, 4, 8)}
    assert fits[cp] and not any(fits[c] for c in fits if c < cp), fits
    assert not estimate_recipe(None, model="llama-7b", seq_len=512 << 10, gpus=8,
                               gpu_memory=80 * GIB, cp=1, checkpointing="none").fits
    data = json.loads(_invoke("estimate-memory", "--model", "llama-7b", "--gpus", "8",
                              "--seq-len", "512k", "--json"))
    assert data["fits"] and data["cp"] == cp and len(data["assumptions"]) == 2


def test_given_settings_are_kept_and_nothing_fits_says_so():
    rng = random.Random(torch.initial_seed())
    cp = rng.choice([1, 2, 4])
    data = json.loads(_invoke("estimate-memory", "--model", "llama-7b", "--gpus", "4", "--cp",
                              str(cp), "--checkpointing", "remat", "--seq-len", "64k", "--json"))
    assert data["cp"] == cp and data["policy"] == "remat" and data["assumptions"] == []
    table = _invoke("estimate-memory", "--model", "llama-7b", "--gpus", "2", "--seq-len", "16m")
    assert _rows(table)["fits"] == "NO" and _rows(table)["cp"] == "2", table
    assert "assumed cp 2: all 2 GPUs, as none fits 16m tokens (--cp to choose)" in table, table
    recipe = json.loads(_invoke("estimate-memory", "llama-7b-256k", "--gpus", "8", "--json"))
    assert recipe["assumptions"] == [] and recipe["cp"] == load_recipe("llama-7b-256k").parallel.cp


def _commands(*args: str) -> tuple[dict, list[list[str]]]:
    data = json.loads(_invoke("estimate-memory", *args, "--plan", "--json"))
    text = _invoke("estimate-memory", *args, "--plan")
    printed = [line.strip() for line in text.splitlines() if line.strip().startswith("lctrain ")]
    assert printed == list(data["commands"].values()) and printed, text
    return data, [shlex.split(line) for line in printed]


def _load(argv: list[str]):
    """The recipe ``lctrain finetune ARGV`` runs, through the same loader."""
    assert argv[:2] == ["lctrain", "finetune"] and "RECIPE" not in argv, argv
    rest, recipe, sets, seq_len = argv[2:], None, [], None
    if rest and not rest[0].startswith("--"):
        recipe, rest = rest[0], rest[1:]
    for flag, value in zip(rest[::2], rest[1::2]):
        if flag == "--set":
            sets.append(value)
        else:
            assert flag == "--seq-len", flag
            seq_len = value
    return load_recipe(recipe, sets, seq_len=seq_len)


def _assert_planned(cfg, choice: dict, machine: dict) -> None:
    assert (cfg.data.seq_len, cfg.parallel.cp, cfg.train.checkpointing, cfg.train.offload,
            cfg.train.tile_tokens, cfg.parallel.head_groups) == (
        choice["seq_len"], choice["cp"], choice["checkpointing"], choice["offload"],
        choice["tile_tokens"], choice["head_groups"])
    est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=machine["gpus"],
                          gpu_memory=machine["gpu_memory"], host_memory=machine["host_memory"],
                          gpus_per_node=machine["gpus_per_node"])
    assert est.per_gpu_bytes["total"] == choice["per_gpu_bytes"]["total"]  # what was planned
    assert est.fits


@pytest.mark.parametrize("where", ["folder", "config.json"])
def test_plan_commands_for_a_model_folder_run_as_printed(tmp_path, where):
    rng = random.Random(torch.initial_seed())
    name = rng.choice(sorted(PRESETS))
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[name]))
    model = str(tmp_path if where == "folder" else tmp_path / "config.json")
    gpus = rng.choice([2, 4])
    length = f"{rng.choice([32, 64, 128])}k"
    # host memory to park state in: without it some presets fit nowhere on 2 x 80 GiB
    data, commands = _commands("--model", model, "--gpus", str(gpus), "--seq-len", length,
                               "--host-memory", "251GiB")
    for argv, key in zip(commands, ("longest", "fastest")):
        cfg = _load(argv)
        assert cfg.model.path == str(tmp_path) and cfg.model.config is None
        assert load_architecture(str(tmp_path)).parameters() == data["parameters_count"]
        _assert_planned(cfg, data[key], data["machine"])
    if where == "folder":
        return
    # with a recipe too: the recipe, and model.path kept (a config.json names its folder)
    data, commands = _commands("llama-7b-256k", "--model", model, "--gpus", str(gpus),
                               "--seq-len", length, "--host-memory", "251GiB")
    for argv, key in zip(commands, ("longest", "fastest")):
        assert argv[2] == "llama-7b-256k"
        cfg = _load(argv)
        assert cfg.model.path == str(tmp_path) and cfg.train.host_memory == 251 * GIB
        assert (cfg.parallel.cp, cfg.train.checkpointing) == (data[key]["cp"],
                                                              data[key]["checkpointing"])


def test_plan_commands_for_a_preset_and_a_recipe_run_as_printed():
    rng = random.Random(torch.initial_seed())
    name = rng.choice(sorted(PRESETS))
    data, commands = _commands("--model", name, "--gpus", "4", "--seq-len", "128k")
    for argv, key in zip(commands, ("longest", "fastest")):
        cfg = _load(argv)
        assert cfg.model.path is None and cfg.model.config == PRESETS[name]  # a random init
        _assert_planned(cfg, data[key], data["machine"])
    data, commands = _commands("llama-7b-256k", "--gpus", "4", "--set", "train.lr=1e-5")
    assert len(commands) == 2
    for argv, key in zip(commands, ("longest", "fastest")):
        assert argv[2] == "llama-7b-256k"
        cfg = _load(argv)
        assert cfg.train.lr == 1e-5
        _assert_planned(cfg, data[key], data["machine"])
