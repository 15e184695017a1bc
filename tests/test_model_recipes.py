"""The shipped recipes for real models: they need model.path, they extend the real models'
configs as their comments say, and they fit the GPUs their comments name."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import is_placeholder, load_recipe, parse_memory
from lctrain.errors import ConfigError
from lctrain.memory import PRESETS, estimate_recipe, recipe_architecture
from lctrain.memory.arch import load_architecture
from lctrain.model import check_model, check_model_config, resolve_config

LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "original_max_position_embeddings": 32768}
REAL = {  # recipe: (preset of the real config.json, RoPE trained with, max_position_embeddings)
    "llama3.1-8b-128k": ("llama3.1-8b", LLAMA31, 131072),
    "llama3.1-8b-512k": ("llama3.1-8b", {**LLAMA31, "factor": 32.0}, 524288),
    "qwen2.5-7b-128k": ("qwen2.5-7b", {**YARN, "factor": 4.0}, 131072),
    "qwen2.5-7b-256k": ("qwen2.5-7b", {**YARN, "factor": 8.0}, 262144),
    "mistral-7b-128k": ("mistral-7b-v0.3", {**YARN, "factor": 4.0}, 131072),
}
FITS = [  # what the recipes' comments promise: (recipe, preset, GPUs, memory per GPU, cp)
    ("llama3.1-8b-128k", "llama3.1-8b", 4, "80GiB", None),
    ("llama3.1-8b-128k", "llama3.1-8b", 2, "139GiB", 2),
    ("llama3.1-8b-512k", "llama3.1-8b", 8, "80GiB", None),
    ("qwen2.5-7b-128k", "qwen2.5-7b", 4, "80GiB", None),
    ("qwen2.5-7b-128k", "qwen2.5-7b", 2, "139GiB", 2),
    ("qwen2.5-7b-256k", "qwen2.5-7b", 8, "80GiB", None),
    ("mistral-7b-128k", "mistral-7b-v0.3", 4, "80GiB", None),
    ("mistral-7b-128k", "mistral-7b-v0.3", 2, "139GiB", 2),
    ("llama3.1-8b-random-128k", None, 2, "139GiB", None),
    ("llama3.1-8b-random-128k", None, 4, "80GiB", 4),
]


@pytest.mark.parametrize("name", REAL)
def test_real_model_recipes_refuse_to_train_until_model_path_is_set(name):
    cfg = load_recipe(name)
    assert is_placeholder(cfg.model.path) and cfg.data.tokenizer is None
    with pytest.raises(ConfigError, match=r"model.path is still the placeholder .*--set model"):
        check_model(cfg)
    result = CliRunner().invoke(app, ["finetune", name])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.count("\n") == 1 and "model.path" in result.stderr


@pytest.mark.parametrize("name", REAL)
def test_real_model_recipes_extend_the_published_config(name, tmp_path):
    """The recipe's overrides on top of the model's published config.json (its shapes and RoPE
    in the older rope_theta / rope_scaling spelling, as the files on the hub have them)."""
    preset, rope, max_positions = REAL[name]
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[preset]))
    cfg = load_recipe(name, [f"model.path={tmp_path}"])
    config = resolve_config(str(tmp_path), cfg.model.config)
    assert config.rope_parameters == rope
    assert config.max_position_embeddings == max_positions >= cfg.data.seq_len
    assert check_model_config(config, seq_len=cfg.data.seq_len, cp=cfg.parallel.cp) == []


@pytest.mark.parametrize("name, preset, gpus, memory, cp", FITS)
def test_recipes_fit_the_gpus_their_comments_name(name, preset, gpus, memory, cp):
    cfg = load_recipe(name)
    est = estimate_recipe(cfg, model=preset, seq_len=cfg.data.seq_len, gpus=gpus,
                          gpu_memory=parse_memory(memory), cp=cp)
    assert est.fits, (name, gpus, memory, est.per_gpu_bytes)


def test_the_benchmark_twin_has_the_shapes_of_llama31_8b():
    cfg = load_recipe("llama3.1-8b-random-128k")
    assert cfg.model.random_init and cfg.data.tokenizer == "byte-pairs"
    assert recipe_architecture(cfg) == replace(load_architecture("llama3.1-8b"), name="llama")
    config = resolve_config(None, cfg.model.config)
    assert (config.vocab_size, config.num_key_value_heads, config.rope_parameters) == (
        128256, 8, LLAMA31)
    assert check_model_config(config, seq_len=cfg.data.seq_len, cp=cfg.parallel.cp) == []
