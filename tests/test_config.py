"""Recipes load, validate and round-trip; every mistake is one ConfigError naming key and source."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from lctrain.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RecipeConfig,
    TrainConfig,
    load_recipe,
    parse_memory,
    parse_size,
    parse_size_list,
    save_resolved,
    shipped_recipes,
)
from lctrain.errors import UserError

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes" / "lctrain_recipes").glob("*.yaml"))


def test_recipes_folder_matches_the_installed_package_data():
    assert {p.name for p in RECIPES} == set(shipped_recipes())
    assert "tiny.yaml" in shipped_recipes()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_validates(path):
    cfg = load_recipe(path)
    assert isinstance(cfg, RecipeConfig)
    assert cfg.data.seq_len % cfg.parallel.seq_chunks == 0
    again = RecipeConfig(**{f.name: type(getattr(cfg, f.name))(**getattr(cfg, f.name).__dict__)
                            for f in dataclasses.fields(cfg)})
    assert again == cfg


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_names_only_real_transformers_config_keys(path):
    transformers = pytest.importorskip("transformers")
    cfg = load_recipe(path)
    if not cfg.model.random_init:
        return  # overrides on top of a model folder: tests/test_model_recipes.py
    model_cfg = transformers.AutoConfig.for_model(**cfg.model.config)
    for key, value in cfg.model.config.items():
        if key != "model_type":
            assert getattr(model_cfg, key) == value, key
    assert model_cfg.max_position_embeddings >= cfg.data.seq_len


def test_default_is_the_embedded_tiny_recipe():
    cfg = load_recipe(None)
    assert cfg == load_recipe(REPO / "recipes" / "lctrain_recipes" / "tiny.yaml")
    assert cfg.data.source == "builtin" and cfg.data.tokenizer == "bytes"
    assert cfg.parallel.cp == 2 and cfg.data.seq_len == 512 and cfg.model.dtype == "float32"
    assert cfg.model.config["num_key_value_heads"] < cfg.model.config["num_attention_heads"]


def test_shipped_recipe_by_name():
    assert load_recipe("llama-7b-64k").data.seq_len == 64 * 1024
    assert load_recipe("llama-7b-256k.yaml").data.seq_len == 256 * 1024
    assert load_recipe("recipes/llama-7b-512k.yaml").data.seq_len == 512 * 1024


def test_overrides_and_flags():
    cfg = load_recipe(None, ["train.lr=1e-4", "model.config.rope_parameters.rope_theta=5e5",
                             "parallel.fsdp=off", "train.betas=[0.8, 0.99]", "data.max_documents=3"],
                      seq_len="1k", output_dir="/tmp/x", max_steps=7)
    assert cfg.train.lr == 1e-4
    assert cfg.model.config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    assert cfg.parallel.fsdp == "off" and cfg.train.betas == (0.8, 0.99)
    assert cfg.data.seq_len == 1024 and cfg.train.output_dir == "/tmp/x" and cfg.train.max_steps == 7
    assert cfg.data.max_documents == 3


def test_switch_to_a_local_model_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    cfg = load_recipe(None, [f"model.path={tmp_path}", "model.config=null", "data.tokenizer=null"])
    assert cfg.model.path == str(tmp_path) and cfg.model.config is None


@pytest.mark.parametrize("overrides, words", [
    (["train.lrr=1"], ["train.lrr", "--set", "'train.lr'"]),
    (["trian.lr=1"], ["trian.lr", "'train'"]),
    (["train.lr=abc"], ["train.lr", "'abc'", "number", "--set train.lr=abc"]),
    (["train.max_steps=1.5"], ["train.max_steps", "whole number"]),
    (["parallel.cp=true"], ["parallel.cp", "True"]),
    (["train.betas=[0.9]"], ["train.betas", "2 values"]),
    (["parallel.schedule=zigzg"], ["parallel.schedule", "'zigzag'"]),
    (["train.lr=-1"], ["train.lr", "positive"]),
    (["train.lr"], ["key=value"]),
    (["train=1"], ["whole section"]),
    (["train.lr.x=1"], ["single setting"]),
    (["data.seq_len=12x"], ["'12x'", "data.seq_len"]),
    (["model.path=/no/such/folder", "model.config=null", "data.tokenizer=null"],
     ["/no/such/folder", "does not exist"]),
    (["model.path=/tmp"], ["data.tokenizer is bytes", "data.tokenizer=null"]),
    (["model.path=/tmp", "data.tokenizer=null"], ["/tmp", "has no config.json"]),
    (["model.config={}"], ["model_type"]),
    (["data.tokenizer=null"], ["data.tokenizer", "bytes"]),
    (["model.config.vocab_size=100"], ["vocab_size", "259"]),
    (["train.batch_size=2"], ["document_mask", "grad_accum=2"]),
    (["data.source=/no/such/*.jsonl"], ["matches no file"]),
])
def test_user_mistakes_are_one_sentence_config_errors(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_recipe(None, overrides)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_seq_len_must_fit_the_layout_chunking():
    with pytest.raises(ConfigError, match=r"1001 is not divisible by 8 \(2 × parallel.cp.*zigzag.*"
                                          r"1000 or 1008.*--seq-len"):
        load_recipe(None, ["parallel.cp=4", "parallel.schedule=zigzag"], seq_len=1001)
    with pytest.raises(ConfigError, match=r"513 is not divisible by 2 \(parallel.cp"):
        load_recipe(None, seq_len=513)
    assert load_recipe(None, ["parallel.cp=3"], seq_len=513).data.seq_len == 513


def test_unknown_keys_in_a_file_name_the_file(tmp_path):
    text = (REPO / "recipes" / "lctrain_recipes" / "tiny.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("  lr: 3.0e-3", "  learning_rate: 3.0e-3"))
    with pytest.raises(ConfigError, match=r"unknown key train.learning_rate in .*bad.yaml"):
        load_recipe(bad)
    bad.write_text(text + "optimizer:\n  name: adamw\n")
    with pytest.raises(ConfigError, match=r"unknown section 'optimizer' in .*bad.yaml"):
        load_recipe(bad)
    bad.write_text(text.replace("  warmup_steps: 4", "  warmup_steps: four"))
    with pytest.raises(ConfigError, match=r"train.warmup_steps must be a whole number.*'four'.*bad.yaml"):
        load_recipe(bad)
    bad.write_text("model: [\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML"):
        load_recipe(bad)
    bad.write_text("data:\n  seq_len: 64\n")
    with pytest.raises(ConfigError, match=r"no model section"):
        load_recipe(bad)


def test_missing_recipe_file_lists_the_shipped_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist.*tiny"):
        load_recipe(tmp_path / "nope.yaml")


def test_config_error_is_a_user_error_and_a_value_error():
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)


def test_dataclasses_are_frozen_keyword_only_and_checked():
    cfg = TrainConfig(lr=1)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        ParallelConfig(2)  # type: ignore[misc]
    with pytest.raises(ConfigError, match="parallel.cp"):
        ParallelConfig(cp=0)
    assert DataConfig(seq_len="64k").seq_len == 65536
    with pytest.raises(ConfigError, match="model.dtype"):
        ModelConfig(config={"model_type": "llama"}, dtype="fp16")
    for cls in (ModelConfig, DataConfig, ParallelConfig, TrainConfig, RecipeConfig):
        source = Path(__import__(cls.__module__, fromlist=["x"]).__file__).read_text()
        for field in dataclasses.fields(cls):
            assert f"    {field.name}:" in source and '"""' in source.split(f"    {field.name}:")[1][:400]


def test_save_resolved_round_trips(tmp_path):
    cfg = load_recipe(None, ["train.lr=5e-4", "parallel.fsdp=off", "train.mixed_precision=no"])
    path = save_resolved(cfg, tmp_path / "run" / "config.yaml")
    moved = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                               output_dir=str(tmp_path / "run")))
    assert load_recipe(path) == moved  # a run's config.yaml trains into the folder holding it
    assert yaml.safe_load(path.read_text())["train"]["lr"] == 5e-4


@pytest.mark.parametrize("text, value", [
    ("512", 512), (512, 512), ("64k", 65536), ("256K", 262144), ("1m", 1024**2), ("2M", 2 * 1024**2),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["12x", "1.5k", "", "k", "-4", "0", True])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError):
        parse_size(text)


def test_parse_size_list_and_memory():
    assert parse_size_list("16k,32k, 64k") == [16384, 32768, 65536]
    assert parse_memory("80GiB") == parse_memory("80G") == 80 * 1024**3
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("141gb") == 141 * 10**9
    with pytest.raises(ConfigError, match="80XB"):
        parse_memory("80XB")
    assert parse_memory(85899345920) == parse_memory("85899345920") == 80 * 1024**3
    for bare in ("141", 141, "80.5"):
        with pytest.raises(ConfigError, match="has no unit.*write it like"):
            parse_memory(bare)


def test_parallel_names_come_from_the_kernels():
    """The product's schedules and every backend lctrain_kernels knows are valid recipe values,
    with their layout's chunking; anything else is refused with the choices."""
    vocabulary = pytest.importorskip("lctrain_kernels.vocabulary")
    for kind in ("distflash", "zigzag"):
        cfg = load_recipe(None, [f"parallel.schedule={kind}", "parallel.cp=3"], seq_len=60)
        assert cfg.parallel.layout == vocabulary.schedule_layout(kind)
        assert cfg.parallel.seq_chunks == 3 * vocabulary.chunks_per_rank(cfg.parallel.layout)
    for name in ("auto", *vocabulary.BACKENDS):
        cfg = load_recipe(None, [f"parallel.attention_backend={name}"])
        assert cfg.parallel.attention_backend == name
    with pytest.raises(ConfigError, match="parallel.attention_backend is 'cpu-flash'.*'cpu_flash'"):
        load_recipe(None, ["parallel.attention_backend=cpu-flash"])


def test_a_data_source_error_says_where_the_value_came_from(tmp_path):
    """data.source (and data.eval_source) errors name the --set that gave the value, like every
    other keyed error, and the recipe file when the value is the file's."""
    missing, folder = tmp_path / "nothere.jsonl", tmp_path / "data"
    folder.mkdir()
    recipe = tmp_path / "my.yaml"
    recipe.write_text((REPO / "recipes" / "lctrain_recipes" / "tiny.yaml").read_text().replace(
        "  source: builtin ", f"  source: {missing} "))
    cwd = Path.cwd()
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, [f"data.source={missing}"])
    assert str(info.value) == (f"data.source {str(missing)!r} matches no file; check the path "
                               f"(relative paths start from {cwd}) "
                               f"(from --set data.source={missing})")
    assert info.value.key == "data.source"
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, [f"data.source={folder}"])
    assert str(info.value) == (f"data.source {str(folder)!r} is a folder; give a file or a glob "
                               f"such as {folder / '*.jsonl'} (from --set data.source={folder})")
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe)
    assert str(info.value).endswith(f"matches no file; check the path (relative paths start "
                                    f"from {cwd}) (in {recipe})")
    with pytest.raises(ConfigError) as info:
        load_recipe(None, [f"data.eval_source={folder}"])
    assert str(info.value) == (f"data.eval_source {str(folder)!r} is a folder; give a file or a "
                               f"glob such as {folder / '*.jsonl'} "
                               f"(from --set data.eval_source={folder})")


def test_recipe_fields_are_at_most_fifty():
    """The typed fields a recipe can set, not counting the free model.config mapping."""
    from lctrain.config.schema import SECTIONS

    names = [f"{section}.{f.name}" for section, cls in SECTIONS.items()
             for f in dataclasses.fields(cls) if (section, f.name) != ("model", "config")]
    assert len(names) <= 50, names


@pytest.mark.parametrize("key, value", [
    ("model.fused_norms", "false"), ("model.fused_rope", "false"), ("model.fused_mlp", "false"),
    ("model.fused_loss", "false"), ("model.grouped_attention", "false"),
    ("model.deferred_norms", "false"), ("parallel.dp", "1"), ("parallel.balance_documents", "true"),
    ("train.layer_policies", "remat=2"), ("train.state_offload", "optimizer"),
    ("train.offload_prefetch", "false"), ("train.planned", "x"), ("train.log_every", "2"),
    ("data.eval_seed", "3"), ("data.cache_dir", "/tmp"), ("checkpoint.enabled", "false"),
    ("checkpoint.on_signal", "false"), ("checkpoint.asynchronous", "on"),
    ("data.text_field", "body"), ("data.split", "test"), ("data.eval_fraction", "0.1"),
])
def test_removed_settings_are_refused_naming_their_replacement(tmp_path, key, value):
    from lctrain.config import REMOVED

    with pytest.raises(ConfigError) as info:
        load_recipe(None, [f"{key}={value}"])
    message = str(info.value)
    assert "\n" not in message and key in message and REMOVED[key] in message
    assert f"--set {key}={value}" in message
    section, name = key.split(".")
    recipe = tmp_path / "old.yaml"  # a recipe file, and a run's saved config.yaml
    text = yaml.safe_load((REPO / "recipes" / "lctrain_recipes" / "tiny.yaml").read_text())
    text.setdefault(section, {})[name] = yaml.safe_load(value)
    recipe.write_text(yaml.safe_dump(text))
    with pytest.raises(ConfigError, match=f"{key} \\(in {recipe}\\) is no longer a setting"):
        load_recipe(recipe)
    from lctrain.config import read_resolved

    with pytest.raises(ConfigError, match="is no longer a setting"):
        read_resolved(recipe)


def test_a_run_config_with_the_folded_data_keys_still_loads(tmp_path):
    """A run's config.yaml from before data.text_field, data.split and data.eval_fraction were
    folded into data.fields, data.source and data.eval_source loads in the new form (to resume,
    export or evaluate the run); a recipe with those keys is refused."""
    import random

    import torch
    from lctrain.config import read_resolved
    from lctrain.config.loader import RESOLVED_HEADER
    from lctrain.config.resume import load_resumed

    rng = random.Random(torch.initial_seed())
    name, split = f"body{rng.randrange(1000)}", rng.choice(["validation", "test", "dev.v2"])
    share = rng.choice([0.05, 0.2, 0.5])
    run = tmp_path / "run"
    cfg = load_recipe(None, output_dir=str(run))
    path = save_resolved(cfg, run / "config.yaml")
    old = yaml.safe_load(path.read_text())
    old["data"].update(text_field="text", split="train", eval_fraction=0.0)  # defaults: dropped
    path.write_text(RESOLVED_HEADER + yaml.safe_dump(old))
    assert load_recipe(path) == cfg == read_resolved(path) == load_resumed(None, output_dir=str(run))
    for source, want in (("someone/docs", f"someone/docs[{split}]"), ("builtin", "builtin")):
        old["data"].update(source=source, text_field=name, split=split, eval_fraction=share,
                           fields={"messages": "dialog"})
        path.write_text(RESOLVED_HEADER + yaml.safe_dump(old))
        for loaded in (load_recipe(path), read_resolved(path),
                       load_resumed(None, output_dir=str(run))):
            assert loaded.data.fields == {"messages": "dialog", "text": name}
            assert (loaded.data.source, loaded.data.eval_source) == (want, share)
            assert loaded.data.eval_fraction == share and loaded.data.text_field == name
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(old))  # no header: a recipe, not a run's config.yaml
    with pytest.raises(ConfigError, match=r"data\.eval_fraction \(in .*\) is no longer a "
                                          r"setting: use data\.eval_source=SHARE"):
        load_recipe(recipe)


def test_a_hub_split_is_named_in_the_source(tmp_path, monkeypatch):
    """``org/name[split]`` is a hub dataset's split unless it matches local files as a glob."""
    from lctrain.config import local_data
    from lctrain.config.hub import hub_split

    assert hub_split("org/name[validation]") == ("org/name", "validation")
    assert hub_split("org/name") == ("org/name", "train")
    assert hub_split("/data/part[12].jsonl") == ("/data/part[12].jsonl", "train")
    assert local_data("org/name[validation]") is None
    assert load_recipe(None, ["data.source=org/name[test]"]).data.source == "org/name[test]"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    for file in ("namet.jsonl", "namet"):
        (tmp_path / "org" / file).write_text('{"text": "x"}\n')
    assert local_data("org/name[st].jsonl").files == [str(Path("org/namet.jsonl"))]
    with pytest.raises(ConfigError, match="matches files ending in"):  # local files win
        local_data("org/name[t]")


@pytest.mark.parametrize("overrides, words", [
    (["train.checkpointing=remat-offload"], "use train.checkpointing=remat with train.offload=layers"),
    (["train.checkpointing=full-offload=1,remat=1"], "train.checkpointing=full with train.offload"),
    (["train.checkpointing=full-paired=2"], "paired layers are gone"),
    (["parallel.schedule=ring"], "lctrain bench attention --peers"),
    (["parallel.schedule=context_parallel"], "lctrain bench attention --peers"),
    (["train.offload=all"], "train.offload=state"),
    (["train.checkpointing=sometimes"], "runs such as full=4,remat=28"),
    (["train.checkpointing=remat=0"], "'remat=0'"),
    (["train.offload=layers,layers=2"], "each at most once"),
    (["train.offload=optimizer,state"], "optimizer or state"),
    (["train.checkpointing=auto", "train.offload=layers=2"], "chooses the parked layers itself"),
    (["train.offload=layers"], "so no layer keeps tensors to park"),
    (["lora.rank=4", "lora.target_modules=q_proj,v_proj"],
     "lora.target_modules is 'q_proj,v_proj', which is one name; write several as a list: "
     "lora.target_modules=[q_proj,v_proj]"),
    (["train.report_to=jsonl,wandb"], "write several as a list: train.report_to=[jsonl,wandb]"),
    (["train.checkpointing=none=2", "train.offload=layers=1"],
     "train.checkpointing is none=2, so no layer keeps tensors to park"),
    (["train.offload=state", "parallel.fsdp=off"], "FSDP2's CPU offload"),
])
def test_checkpointing_language_mistakes_are_one_sentence(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_recipe(None, overrides)
    assert "\n" not in str(info.value) and words in str(info.value)


def test_checkpointing_language_parses_and_prints_what_it_parsed(tmp_path):
    from lctrain.config import LayerPlan

    cfg = load_recipe(None, ["train.checkpointing= full=1, remat=1", "train.offload=optimizer,layers=1"])
    assert (cfg.train.checkpointing, cfg.train.offload) == ("full=1,remat=1", "layers=1,optimizer")
    plan = cfg.train.layers
    assert plan.kinds(2) == ("full", "remat") and plan.parked_layers(2) == (True, False)
    assert plan.state == "optimizer" and not plan.auto
    saved = yaml.safe_load(save_resolved(cfg, tmp_path / "config.yaml").read_text())["train"]
    assert (saved["checkpointing"], saved["offload"]) == ("full=1,remat=1", "layers=1,optimizer")
    every = LayerPlan.parse("none=1,remat=3", "layers,state")
    assert every.parked_layers(4) == (False, True, True, True) and every.offload == "layers,state"
    assert LayerPlan.parse("remat").kinds(3) == ("remat",) * 3
    assert LayerPlan.parse("auto").auto and LayerPlan.parse("auto").checkpointing == "auto"
    with pytest.raises(ConfigError, match="covers 2 layers but the model has 3"):
        LayerPlan.parse("full=1,remat=1").kinds(3)
    with pytest.raises(ConfigError, match="parks 4 layers but the model has 3"):
        LayerPlan.parse("full", "layers=4").parked_layers(3)


@pytest.mark.parametrize("item, shown", [("train.lr=1e39", "1e+39"), ("train.lr=-4e38", "-4e+38"),
                                          ("train.weight_decay=3.5e38", "3.5e+38")])
def test_a_float_that_float32_cannot_hold_is_refused(item, shown):
    key = item.split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_recipe(None, [item])
    assert str(info.value).startswith(f"{key} is {shown}, which overflows float32")
    assert info.value.key == key
    largest = load_recipe(None, ["train.lr=3.4e38"])  # the largest float32 still trains
    assert largest.train.lr == 3.4e38


@pytest.mark.parametrize("item, meant", [
    ("train.learning_rate=1e-4", "train.lr"), ("data.dataset=x.jsonl", "data.source"),
    ("train.num_train_epochs=2", "train.epochs"), ("lora.lora_r=8", "lora.rank"),
    ("lora.lora_alpha=16", "lora.alpha"), ("data.max_seq_length=4k", "data.seq_len"),
    ("data.sequence_len=4k", "data.seq_len"),
    ("train.gradient_accumulation_steps=4", "train.grad_accum"),
    ("train.per_device_train_batch_size=2", "train.batch_size"),
    ("data.output_dir=x", "train.output_dir"),
    ("learning_rate=1e-4", "train.lr"), ("train.datasets=x", "data.source"),
    ("train.chat_template=chatml", "data.chat_template"), ("data.mask_history=true", "data.turns"),
    ("data.field_messages=conversations", "data.fields"), ("data.columns=x", "data.fields"),
    ("data.formatting=sharegpt", "data.format"), ("data.val_set_size=0.05", "data.eval_source"),
    ("train.dataset_text_field=body", "data.fields"),
    ("data.alpha=16", "lora.alpha"), ("lora.seed=3", "train.seed")])  # a setting's own name
def test_names_from_other_tools_point_to_the_setting(item, meant):
    with pytest.raises(ConfigError) as info:
        load_recipe(None, [item])
    assert f"; did you mean {meant}?" in str(info.value)


def test_a_recipe_file_with_trainer_names_points_to_the_settings(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {config: {model_type: llama}}\nlearning_rate: 0.001\n")
    with pytest.raises(ConfigError, match=r"section 'learning_rate' .*did you mean train\.lr"):
        load_recipe(recipe)


def test_a_run_config_names_every_local_path_absolutely(tmp_path, monkeypatch):
    """A relative data.eval_source is saved absolute like data.source, so RUN/config.yaml runs
    from any folder; a built-in tokenizer stays built-in whatever the folder holds."""
    monkeypatch.chdir(tmp_path)
    for name in ("train.jsonl", "val.jsonl"):
        (tmp_path / name).write_text('{"text": "hello"}\n')
    (tmp_path / "byte-pairs").mkdir()
    (tmp_path / "bytes").mkdir()
    cfg = load_recipe(None, ["data.source=train.jsonl", "data.eval_source=val.jsonl",
                             "data.tokenizer=byte-pairs", "model.config.vocab_size=65795"],
                      output_dir="run")
    assert cfg.data.eval_source == str(tmp_path / "val.jsonl")
    assert cfg.data.tokenizer == "byte-pairs"
    assert load_recipe(None, ["data.eval_source=0.25"]).data.eval_source == 0.25
    assert load_recipe(None, ["data.eval_source=org/name[validation]"]).data.eval_source == \
        "org/name[validation]"
    path = save_resolved(cfg, tmp_path / "run" / "config.yaml")
    monkeypatch.chdir(tmp_path / "run")
    assert load_recipe(path) == cfg
    from lctrain.config.resume import load_resumed

    monkeypatch.chdir(tmp_path)  # a run saved with the relative path still resumes from here
    old = path.read_text().replace(str(tmp_path / "val.jsonl"), "val.jsonl")
    assert "eval_source: val.jsonl" in old
    path.write_text(old)
    assert load_resumed(None, output_dir="run") == cfg


def test_resume_with_the_run_folder_given_by_set_reads_that_run(tmp_path):
    """``--resume --set train.output_dir=RUN`` is ``--resume --output-dir RUN``: the run's own
    recipe is checked, not the embedded one's (whose seq_len 512 does not divide by 3)."""
    from lctrain.config.resume import load_resumed

    run = tmp_path / "run"
    cfg = load_recipe(None, ["data.document_mask=false", "parallel.cp=3"], seq_len=513,
                      output_dir=str(run))
    save_resolved(cfg, run / "config.yaml")
    for flag in ([f"train.output_dir={run}"], []):
        resumed = load_resumed(None, [*flag, "train.batch_size=2", "parallel.cp=3"],
                               output_dir=None if flag else str(run))
        assert resumed == dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, batch_size=2))
    with pytest.raises(ConfigError, match="--resume cannot change train.lr"):
        load_resumed(None, [f"train.output_dir={run}", "train.lr=1"])


def test_a_saved_run_config_loads_back_equal_whatever_the_values(tmp_path):
    """Random valid settings, strings that look like numbers among them ("1e5", "on", "010"):
    RUN/config.yaml loads back as the very recipe that was saved."""
    import random

    import torch

    rng = random.Random(torch.initial_seed())
    choices = {
        "train.lr": ["1e-4", "3.0e-5", "2E-3", "1"], "train.epochs": ["1.5", "2", "null"],
        "train.betas": ["[0.8, 0.99]", "[0, 0.5]"], "train.host_memory": ["80GiB", "80GB", "null"],
        "train.tile_tokens": ["0", "1k"], "train.checkpointing": ["remat", "auto", "full=1,remat=1"],
        "train.offload": ["none", "optimizer"], "train.report_to": ["jsonl", "[wandb, mlflow]"],
        "train.collective_timeout": ["60", "1e3"], "train.seed": ["0", "4294967295"],
        "data.eval_source": ["0.05", "null", "org/1e5[test]"], "data.turns": ["last", "all"],
        "data.fields": ["null", "{text: body}", "{text: '1e5'}", "{text: '-2.5E+3'}"],
        "model.config.note": ["'1e5'", "'1E-5'", "'on'", "'010'", "'1:30'", "'~'", "'.5'"],
        "parallel.fsdp": ["on", "off", "auto"], "checkpoint.export_final": ["false", "true"],
    }
    for _ in range(30):
        items = [f"{key}={rng.choice(values)}" for key, values in choices.items()
                 if rng.random() < 0.6]
        cfg = load_recipe(None, items, output_dir=str(tmp_path / "run"))
        path = save_resolved(cfg, tmp_path / "run" / "config.yaml")
        assert load_recipe(path) == cfg, items


def test_a_run_folder_given_as_the_recipe_points_to_its_config(tmp_path):
    """``lctrain finetune RUN`` (as ``export RUN``): the suggested file is RUN's config.yaml,
    which exists and loads."""
    run = tmp_path / "run"
    save_resolved(load_recipe(None, output_dir=str(run)), run / "config.yaml")
    with pytest.raises(ConfigError) as info:
        load_recipe(run)
    assert str(info.value).endswith(f"is a folder; give a YAML file such as {run / 'config.yaml'}")
    assert load_recipe(run / "config.yaml").train.output_dir == str(run)


@pytest.mark.parametrize("value", ["*.jsonl", "@data/it's.jsonl", "!x"])
def test_a_value_yaml_cannot_read_gets_a_set_that_works(value):
    """The shell takes away the quotes a user types around a --set value: the error shows the
    YAML quotes inside the shell's, and that value, unquoted by the shell, loads."""
    import shlex

    with pytest.raises(ConfigError) as info:
        load_recipe(None, [f"data.source={value}"])
    suggested = str(info.value).split("e.g. --set ", 1)[1].split(", or write", 1)[0]
    (item,) = shlex.split(suggested)
    from lctrain.config.loader import parse_override

    assert parse_override(item) == ("data.source", value)  # the string the user meant
