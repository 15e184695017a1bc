"""Hugging Face export, in one process (the runs trained on two ranks are in
test_export_lora.py):

- the byte tokenizer is exported as a fast tokenizer that tokenizes and decodes exactly alike;
- a tied-embeddings model saved by the real checkpoint writer exports and reloads as itself;
- a shard limit below the model's size gives several shards and an index that reload;
- every user mistake is one sentence at the command line (an output that cannot be written
  too), and nothing half-written is left.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe, save_resolved


def _cfg(out: Path, **sets):
    base = {"data.seq_len": 128, "data.max_documents": 24, "train.max_steps": 3,
            "train.warmup_steps": 1, "train.loss_chunk_tokens": 48, "train.lr": 3e-3,
            "parallel.attention_backend": "reference", "parallel.cp": 2, "parallel.fsdp": "on",
            "checkpoint.every": 2, "checkpoint.keep": 3}
    base.update(sets)
    return load_recipe(None, [f"{k}={v}" for k, v in base.items()], output_dir=str(out))


def _reload_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_byte_tokenizer_export_tokenizes_as_lctrain(tmp_path):
    from transformers import AutoTokenizer

    from lctrain.data.tokenizer import ByteTokenizer, encode_documents
    from lctrain.export.write import byte_tokenizer_fast

    byte_tokenizer_fast().save_pretrained(tmp_path)
    exported, ours = AutoTokenizer.from_pretrained(tmp_path), ByteTokenizer()
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    alphabet = "abc XYZ\n\t€ü😀ß\x00<>/" + "".join(chr(rng.randrange(32, 0x3000)) for _ in range(20))
    texts = ["", "<bos> is text here <eos><pad>"] + [
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60))) for _ in range(30)]
    assert encode_documents(exported, texts) == encode_documents(ours, texts)  # training ids
    for text in texts:
        ids = ours.encode(text)
        assert exported(text)["input_ids"] == ids[:-1], text  # a prompt: <bos>, no <eos>
        assert exported.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text
    raw = [rng.randrange(256) for _ in range(200)]  # arbitrary bytes: invalid UTF-8 replaced alike
    assert exported.decode(raw) == ours.decode(raw)
    assert (exported.bos_token_id, exported.eos_token_id, exported.pad_token_id) == (256, 257, 258)


def _saved_run(tmp_path: Path, name: str, **sets):
    """A run folder whose one-step checkpoint the real writer saved in this one process; returns
    the trained model (a peft model for a LoRA recipe)."""
    from lctrain.model import load_model
    from lctrain.model.lora import apply_lora
    from lctrain.checkpoint.writer import Checkpointer
    from lctrain.train.loop import CausalLMLoss
    from lctrain.train.optim import build_optimizer

    cfg = _cfg(tmp_path / name, **sets)
    save_resolved(cfg, tmp_path / name / "config.yaml")
    model = load_model(None, config=cfg.model.config, seed=cfg.train.seed)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora, seed=cfg.train.seed)
    module = CausalLMLoss(model, 64)
    optimizer, scheduler = build_optimizer(module, lr=1e-2, weight_decay=0.0, warmup_steps=0,
                                           total_steps=2, min_lr_ratio=0.1)
    ids = torch.randint(0, 259, (1, 16))
    module(ids, ids, torch.arange(16)[None]).backward()
    optimizer.step()  # an optimizer state the export must leave unread
    saver = Checkpointer(tmp_path / name / "checkpoints", module=module, optimizer=optimizer,
                         keep=1, asynchronous=False)
    saver.save(1, {"step": 1, "rows_consumed": 1, "tokens_consumed": 16, "seq_len": 16,
                   "rows_per_step": 1, "layout": {"dp": 1, "cp": 1, "world_size": 1},
                   "lr_plan": scheduler.lr_lambdas[0].to_json()})
    saver.close()
    model.set_attn_implementation("eager")
    return model.eval()


def test_tied_embeddings_export_and_shards(tmp_path):
    from lctrain.export import export_run, write
    from lctrain.export.run import trained_model

    model = _saved_run(tmp_path, "tied", **{"model.config.tie_word_embeddings": "true"})
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    result = export_run(tmp_path / "tied", output=tmp_path / "out")
    assert (result.kind, result.step, result.dtype) == ("full", 1, "float32")
    assert "tokenizer.json" in result.files and not result.tokenizer_note  # bytes as transformers
    ids = torch.randint(0, 259, (2, 24))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(_reload_logits(tmp_path / "out", ids), expected,
                               rtol=1e-5, atol=1e-5)

    cfg = load_recipe(tmp_path / "tied" / "config.yaml")
    rebuilt = trained_model(cfg, tmp_path / "tied" / "checkpoints" / "step-00000001")
    write.write_full(rebuilt, tmp_path / "sharded", torch.float32, max_shard_size="60KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / "sharded" / s).stat().st_size < 200_000
                                   for s in shards)
    torch.testing.assert_close(_reload_logits(tmp_path / "sharded", ids), expected,
                               rtol=1e-5, atol=1e-5)


def test_random_init_lora_exports_its_base_beside_the_adapter(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lctrain.export import export_run
    from lctrain.model import load_model

    model = _saved_run(tmp_path, "lora", **{"lora.rank": 4, "lora.trainable_modules": "[norm]"})
    result = export_run(tmp_path / "lora", output=tmp_path / "adapter")
    assert result.kind == "adapter"
    assert result.base == str((tmp_path / "adapter" / "base").resolve())
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == result.base
    cfg = load_recipe(tmp_path / "lora" / "config.yaml")
    init = load_model(None, config=cfg.model.config, seed=cfg.train.seed)
    saved = load_file(tmp_path / "adapter" / "base" / "model.safetensors")
    for name, tensor in init.state_dict().items():  # the base is the frozen initial weights
        assert torch.equal(saved[name], tensor), name
    base = AutoModelForCausalLM.from_pretrained(result.base, attn_implementation="eager")
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = torch.randint(0, 259, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    assert (tmp_path / "adapter" / "tokenizer.json").is_file()
    assert (tmp_path / "adapter" / "base" / "tokenizer.json").is_file()


def test_export_mistakes_are_one_sentence(tmp_path):
    runner = CliRunner()
    run = tmp_path / "run"

    def error(*args):
        result = runner.invoke(app, ["export", *map(str, args)])
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        return " ".join(result.output.split())

    assert "there is no run folder" in error(tmp_path / "missing", "--output", tmp_path / "o")
    run.mkdir()
    assert "has no config.yaml" in error(run, "--output", tmp_path / "o")
    save_resolved(_cfg(run), run / "config.yaml")
    assert "no complete checkpoint" in error(run, "--output", tmp_path / "o")
    for step in (2, 6):
        (run / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    (run / "checkpoints" / ".tmp-step-00000009").mkdir()
    assert "no checkpoint of step 9" in error(run, "--step", 9, "--output", tmp_path / "o")
    assert "holds step(s) 2, 6" in error(run, "--step", 4, "--output", tmp_path / "o")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "exists and is not empty" in error(run, "--output", tmp_path / "full")
    assert "is a file" in error(run, "--output", tmp_path / "full" / "x")
    assert "no adapter to merge" in error(run, "--merge", "--output", tmp_path / "o")
    assert "not one of" in runner.invoke(
        app, ["export", str(run), "--output", "o", "--dtype", "float16"]).output.replace("\n", " ")
    assert "cannot be read" in error(run, "--output", tmp_path / "o")  # empty checkpoint folder
    assert not (tmp_path / "o").exists()  # nothing half-written is left
    deep = tmp_path / "new" / "deep" / "o"
    assert "cannot be read" in error(run, "--output", deep)
    assert not (tmp_path / "new").exists()  # nor the folders made for it
    afile = tmp_path / "full" / "x"
    assert f"the output {afile / 'sub'} cannot be written ({afile} is a file, not a folder)" \
        in error(run, "--output", afile / "sub")
    if Path("/proc/self").is_dir():  # a pseudo file system that takes no new folder
        assert "the output /proc/x cannot be written (No such file or directory); choose a " \
            "folder you may write to" in error(run, "--output", "/proc/x")


def test_byte_pairs_export_carries_the_special_ids_trained_on(tmp_path):
    """A random init trained with the byte-pairs tokenizer: config.json and
    generation_config.json name its bos/eos/pad ids, not the model family's defaults (which
    are byte pairs here), so that generate() stops at the end-of-text token it learnt."""
    from lctrain.data import BytePairTokenizer
    from lctrain.export import export_run

    _saved_run(tmp_path, "pairs", **{"data.tokenizer": "byte-pairs",
                                     "model.config.vocab_size": len(BytePairTokenizer())})
    result = export_run(tmp_path / "pairs", output=tmp_path / "out")
    assert "byte-pairs tokenizer has no transformers equivalent" in result.tokenizer_note
    want = {"bos_token_id": BytePairTokenizer.bos_token_id,
            "eos_token_id": BytePairTokenizer.eos_token_id,
            "pad_token_id": BytePairTokenizer.pad_token_id}
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((tmp_path / "out" / name).read_text())
        assert {key: saved.get(key) for key in want} == want, name


def test_a_checkpoint_with_a_cut_or_missing_shard_is_one_sentence(tmp_path):
    """A shard cut short or deleted (a copy that failed): export says the checkpoint is
    damaged, naming the missing file, instead of DCP's traceback."""
    _saved_run(tmp_path, "run")
    shard = next((tmp_path / "run" / "checkpoints").glob("step-*/*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:64])
    for words in ("cannot be loaded", f"No such file or directory: {shard}"):
        if shard.exists() and "No such file" in words:
            shard.unlink()
        result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--output",
                                          str(tmp_path / "out")])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.exit_code == 1 and len(lines) == 1, result.output
        assert words in lines[0] and "damaged" in lines[0], lines
