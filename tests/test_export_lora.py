"""Trained with cp = 2 under FSDP2 on two gloo ranks, exported, reloaded with plain transformers
and peft: the export is the trained model. One spawn trains every run the tests below check.

- Full fine-tuning (random init, byte tokenizer): ``lctrain export`` of the last and of an
  earlier checkpoint, and the ``final/`` that finetune wrote, reload with transformers' eager
  model and give the logits of the model as lctrain trained it (cp = 2, lctrain attention,
  restored by DCP's own collective load) within fp32 rounding; ``--dtype bfloat16`` rounds the
  same weights.
- LoRA on a model folder (remat, adapter dropout, embeddings and final norm trained in full):
  only the adapters and the named modules change (the checkpoint's base weights equal the
  folder's); a resumed run repeats the straight run's losses; the adapter export loads with peft
  onto the folder and gives the trained model's logits; ``--merge`` writes base + B·A·alpha/r
  (computed here in float64 from the adapter file) and the trained copies, nothing else changed.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe
from spawn import run_on_ranks

TARGETS = ("q_proj", "v_proj", "down_proj")
TRAINED = ("embed_tokens", "norm")
RANK, ALPHA = 4, 12.0
COMMON = {"data.seq_len": 128, "data.max_documents": 24, "train.warmup_steps": 1,
          "train.loss_chunk_tokens": 48, "parallel.attention_backend": "reference",
          "parallel.cp": 2, "parallel.fsdp": "on", "checkpoint.every": 2, "checkpoint.keep": 3}


def _recipe(out: Path, **sets):
    values = {**COMMON, **sets}
    return load_recipe(None, [f"{k}={v}" for k, v in values.items()], output_dir=str(out))


def _lora_recipe(out: Path, base: Path):
    return _recipe(out, **{
        "model.path": str(base), "model.config": "null", "data.tokenizer": "null",
        "train.max_steps": 4, "train.lr": 1e-2, "train.checkpointing": "remat",
        "lora.rank": RANK, "lora.alpha": ALPHA, "lora.dropout": 0.1,
        "lora.target_modules": f"[{','.join(TARGETS)}]",
        "lora.trainable_modules": f"[{','.join(TRAINED)}]"})


def _base_folder(path: Path) -> Path:
    """A Llama model folder with its own (offline BPE) tokenizer, as a user's would be."""
    from model_folders import make_model_folder

    return make_model_folder(path.parent, "llama2", name=path.name, intermediate_size=176,
                             max_position_embeddings=1024)


def _metrics(cfg) -> list[dict]:
    path = Path(cfg.train.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train_all(rank, world, full, lora, resumed, ids):
    import torch.distributed as dist

    from lctrain.train.runner import run_worker
    from trained_logits import training_logits

    run_worker(full)
    run_worker(lora)
    if rank == 0:
        src = Path(lora.train.output_dir) / "checkpoints" / "step-00000002"
        shutil.copytree(src, Path(resumed.train.output_dir) / "checkpoints" / src.name)
        shutil.copy(Path(lora.train.output_dir) / "config.yaml",  # the run's own recipe
                    Path(resumed.train.output_dir) / "config.yaml")
    dist.barrier()
    run_worker(resumed, resume=True)
    logits = {(cfg.train.output_dir, step): training_logits(
        cfg, Path(cfg.train.output_dir) / "checkpoints" / f"step-{step:08d}", ids)
        for cfg, step in ((full, 2), (full, 3), (lora, 4))}
    if rank != 0:
        return None
    return {"lora": _metrics(lora), "resumed": _metrics(resumed), "logits": logits}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    base = _base_folder(root / "base")
    full = _recipe(root / "full", **{"train.max_steps": 3, "train.lr": 3e-3})
    lora, resumed = _lora_recipe(root / "lora", base), _lora_recipe(root / "resumed", base)
    ids = torch.randint(0, 259, (1, 64))
    result = run_on_ranks(_train_all, 2, full, lora, resumed, ids)[0]
    logits = {(Path(out).name, step): value for (out, step), value in result["logits"].items()}
    return {"root": root, "base": base, "ids": ids, "logits": logits, "full": full,
            "lora_metrics": result["lora"], "resumed_metrics": result["resumed"]}


def _export(*args) -> str:
    result = CliRunner().invoke(app, ["export", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


def _reload_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_full_export_reloads_as_the_trained_model(runs):
    root, ids, logits, cfg = runs["root"], runs["ids"], runs["logits"], runs["full"]
    assert "of step 3 (float32)" in _export(root / "full", "--output", root / "last")
    _export(root / "full", "--step", 2, "--output", root / "step2")
    _export(root / "full", "--dtype", "bfloat16", "--output", root / "bf16")
    for folder, step in (("last", 3), ("step2", 2), ("full/final", 3)):
        torch.testing.assert_close(_reload_logits(root / folder, ids), logits["full", step],
                                   rtol=1e-5, atol=1e-5)
    assert (logits["full", 3] - logits["full", 2]).abs().max() > 1e-3  # the steps really differ

    text = (root / "last" / "config.json").read_text()
    config = json.loads(text)
    theta = cfg.model.config["rope_parameters"]["rope_theta"]
    assert config["rope_parameters"]["rope_theta"] == theta and "lctrain" not in text
    assert config["use_cache"] is True and config["dtype"] == "float32"
    specials = (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
    assert specials == (256, 257, 258)  # the byte tokenizer's, not Llama's defaults
    assert sorted(p.name for p in (root / "last").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    full, half = (load_file(root / f / "model.safetensors") for f in ("last", "bf16"))
    assert full.keys() == half.keys()
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[name].bfloat16()), name


def test_lora_trains_adapters_only_and_resumes_exactly(runs):
    straight, resumed = runs["lora_metrics"], runs["resumed_metrics"]
    assert straight[0]["attention_forward_calls"] == 2  # remat: once per layer, LoRA layers too
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(straight[2:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert straight[-1]["loss"] < straight[0]["loss"]

    from lctrain.config import read_resolved
    from lctrain.export.run import base_weights, skeleton
    from lctrain.checkpoint.reader import read_model_weights

    run, original = runs["root"] / "lora", load_file(runs["base"] / "model.safetensors")
    names = list(skeleton(read_resolved(run / "config.yaml")).state_dict())
    saved = read_model_weights(run / "checkpoints" / "step-00000004", names)
    frozen = base_weights(saved)
    assert frozen.keys() == original.keys()
    for name, tensor in frozen.items():
        assert torch.equal(tensor, original[name]), name
    moved = [n for n, t in saved.items() if ".lora_B." in n and t.abs().max() > 0]
    assert len(moved) == 2 * len(TARGETS)  # every adapter's B left zero (2 layers)
    copies = [n for n in saved if ".modules_to_save." in n]
    assert len(copies) == len(TRAINED)
    for name in copies:
        plain = name.replace("base_model.model.", "").replace(".modules_to_save.default", "")
        assert not torch.equal(saved[name], original[plain]), name


def test_lora_adapter_and_merged_exports(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, base, ids = runs["root"], runs["base"], runs["ids"]
    adapter_dir, merged_dir = root / "lora" / "final", root / "merged"
    assert "LoRA merged in" in _export(root / "lora", "--merge", "--output", merged_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    adapter = load_file(adapter_dir / "adapter_model.safetensors")
    merged = load_file(merged_dir / "model.safetensors")
    original = load_file(base / "model.safetensors")
    assert merged.keys() == original.keys()
    for name, weight in merged.items():
        key = "base_model.model." + name.removesuffix(".weight")
        if name.split(".")[-2] in TARGETS:
            a = adapter[f"{key}.lora_A.weight"].double()  # (r, in)
            b = adapter[f"{key}.lora_B.weight"].double()  # (out, r)
            expected = original[name].double() + b @ a * (ALPHA / RANK)
            torch.testing.assert_close(weight.double(), expected, rtol=0, atol=1e-6, msg=name)
        elif f"{key}.weight" in adapter:  # a module trained in full: its trained copy
            assert name.split(".")[-2] in TRAINED and torch.equal(weight, adapter[f"{key}.weight"])
        else:
            assert torch.equal(weight, original[name]), name

    plain = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager")
    with_adapter = PeftModel.from_pretrained(plain, adapter_dir).eval()
    with torch.no_grad():
        adapted = with_adapter(input_ids=ids).logits
    want = runs["logits"]["lora", 4]
    for logits in (adapted, _reload_logits(merged_dir, ids)):  # fp32: 1e-5 of the logits' scale
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_an_adapter_folder_evaluates_as_its_merged_model(runs, tmp_path):
    """``lctrain eval`` of a peft adapter (the export of a LoRA run) loads its base model and
    merges the adapter with peft; lctrain's own --merge export must score the same."""
    root = runs["root"]
    adapter_dir, merged_dir = root / "lora" / "final", tmp_path / "merged"
    _export(root / "lora", "--merge", "--output", merged_dir)
    scores = {}
    for name, folder in (("adapter", adapter_dir), ("merged", merged_dir)):
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(app, ["eval", str(folder), "--task", "ppl", "--cp", "1",
                                          "--seq-len", "128", "--max-rows", "2", "--bucket", "64",
                                          "--json", str(out)])
        assert result.exit_code == 0, result.output
        document = json.loads(out.read_text())
        scores[name] = {row["bucket"]: row["loss"] for row in document["rows"]}
        assert document["meta"]["kind"] == ("adapter" if name == "adapter" else "model")
    assert scores["adapter"].keys() == scores["merged"].keys()
    for bucket, loss in scores["merged"].items():
        assert scores["adapter"][bucket] == pytest.approx(loss, rel=1e-5), bucket
    base_only = tmp_path / "base.json"  # the adapter changes the scores: it was merged
    CliRunner().invoke(app, ["eval", str(runs["base"]), "--task", "ppl", "--cp", "1",
                             "--seq-len", "128", "--max-rows", "2", "--bucket", "64",
                             "--json", str(base_only)])
    base_loss = json.loads(base_only.read_text())["rows"][-1]["loss"]
    assert abs(base_loss - scores["adapter"]["all"]) > 1e-4
