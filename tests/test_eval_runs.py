"""Evaluation end to end on gloo ranks, against plain transformers on one process.

- validation during training: the eval loss at cp = 2 equals the one at cp = 1 (dp = 2, whose
  ranks split the validation rows) and equals a hand computation — plain transformers (eager
  attention, one document at a time) on the exported final weights over the held-out rows;
  the TensorBoard files hold the logged scalars (read back with EventAccumulator); ``lctrain
  eval`` of the run folder (its checkpoint through DCP) gives that loss again;
- the distributed prefill (cp = 2, distflash and zigzag layouts, plain and under FSDP2) gives
  the next-token logits of a single-process forward, and every decoding step (keys and values
  left on their ranks, partial attentions merged) the logits of a single-process forward over
  prompt + answer;
- ``lctrain eval --task ppl`` as the 2 ranks of a launched job (as under torchrun; zigzag:
  every rank holds two far-apart pieces of each row; FSDP2) equals transformers' eager loss
  bucket by bucket (fp32, 1e-5); one rank self-launched through ``python -m lctrain.eval``
  runs too;
- ``lctrain eval --task passkey`` runs end to end: prompts, needles, answers, table, JSON, plot.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import DataConfig, load_recipe
from lctrain.data import ByteTokenizer, prepare_data
from eval_reference import eager_losses, eager_model, save_tiny_model, texts
from spawn import run_on_ranks

runner = CliRunner()


# ---------------------------------------------------------------- model folder, ppl, passkey

@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny random Llama with the byte tokenizer's transformers twin, as a model folder."""
    return save_tiny_model(tmp_path_factory.mktemp("model"), random.randrange(2**31))


# ---------------------------------------------------------------- two gloo ranks, one spawn

def _on_two_ranks(rank, world, cfgs, folder, prompt, steps, cli_runs):
    """Everything these tests need from two ranks: training runs with validation, the
    distributed prefill and decoding of one prompt (plain, then under FSDP2), and ``lctrain
    eval`` commands as the ranks of a launched job (as under torchrun)."""
    import os

    from lctrain.model.structure import decoder_layers
    from lctrain.parallel.fsdp import distribute

    from accelerate import Accelerator

    from lctrain.eval.decode import generate, register_eval_attention
    from lctrain.eval.evaluate import EvalModel
    from lctrain.model import load_model
    from lctrain.parallel.context import ContextParallel
    from lctrain.parallel.mesh import build_mesh
    from lctrain.train.runner import run_worker

    runs = []
    for cfg in cfgs:
        assert run_worker(cfg) == 0
        path = Path(cfg.train.output_dir) / "metrics.jsonl"
        runs.append([json.loads(x) for x in path.read_text().splitlines()] if rank == 0 else None)
    accelerator = Accelerator(cpu=True)
    pmesh = build_mesh(2, device_type="cpu")
    model = load_model(str(folder), config=None, seed=0,
                       attn_implementation=register_eval_attention())
    module = EvalModel(model, chunk_tokens=64).eval()
    decoded = {}
    for schedule in ("distflash", "zigzag"):
        if schedule == "zigzag":  # the same weights, sharded: every forward gathers them
            module = distribute(module, decoder_layers(model), world_mesh=pmesh.world_mesh,
                                strategy="fsdp", param_dtype=None).module
        cp = ContextParallel(pmesh, schedule, "reference", device=torch.device("cpu"))
        tokens, logits = generate(module, prompt, steps, cp=cp, accelerator=accelerator,
                                  keep_logits=True)
        decoded[schedule] = (tokens, [x.tolist() for x in logits])  # no tensor crosses processes
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))  # what torchrun sets: lctrain eval joins
    outputs = []
    for args in cli_runs:
        result = runner.invoke(app, args)
        outputs.append((result.exit_code, result.stdout))
    return runs, decoded, outputs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, model_folder):
    """The validation runs (cp = 2 and dp = 2) and the decoding on two ranks, run once."""
    tmp = tmp_path_factory.mktemp("runs")
    rng = random.Random(random.randrange(2**31))
    source = texts(tmp / "docs.jsonl", 30, rng)

    def cfg(name, **sets):
        base = {"data.source": str(source), "data.seq_len": 128, "data.eval_source": 0.2,
                "train.eval_every": 2,
                "train.max_steps": 3, "train.warmup_steps": 1, "train.loss_chunk_tokens": 48,
                "train.lr": 3e-3, "parallel.attention_backend": "reference",
                "parallel.fsdp": "off", "checkpoint.keep": 0}
        base.update(sets)
        return load_recipe(None, [f"{k}={v}" for k, v in base.items()],
                           output_dir=str(tmp / name))

    seed = rng.randrange(1000)
    cfgs = [cfg("cp2", **{"parallel.cp": 2, "train.grad_accum": 2, "checkpoint.every": 2,
                          "checkpoint.keep": 2, "train.seed": seed}),
            cfg("dp2", **{"parallel.cp": 1, "train.grad_accum": 1, "train.report_to": "jsonl",
                          "train.seed": seed})]
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    prompt = torch.randint(0, 256, (96,), generator=gen).tolist()
    ppl_data, ppl_json = texts(tmp / "eval.jsonl", 10, rng, longest=500), tmp / "ppl.json"
    cli_runs = [
        ["eval", str(model_folder), "--task", "ppl", "--cp", "2", "--seq-len", "256",
         "--bucket", "48", "--data", str(ppl_data), "--set", "parallel.schedule=zigzag",
         "--set", "parallel.attention_backend=reference", "--set", "parallel.fsdp=on",
         "--json", str(ppl_json), "--format", "csv"],
        # the cp = 2 run's checkpoint, on its own validation rows and settings
        ["eval", cfgs[0].train.output_dir, "--json", str(tmp / "run.json")],
        ["eval", cfgs[0].train.output_dir, "--step", "2", "--json", str(tmp / "run2.json")],
        ["eval", str(Path(cfgs[0].train.output_dir) / "checkpoints" / "step-00000002"),
         "--json", str(tmp / "ckpt2.json")]]
    (runs, decoded, cli), (_, decoded_1, cli_1) = run_on_ranks(
        _on_two_ranks, 2, cfgs, model_folder, prompt, 5, cli_runs)
    return {"cfgs": cfgs, "runs": runs, "decoded": decoded, "decoded_1": decoded_1,
            "prompt": prompt, "steps": 5, "ppl": cli[0], "ppl_other_rank": cli_1[0],
            "ppl_data": ppl_data, "ppl_json": ppl_json, "run_eval": cli[1],
            "run_json": tmp / "run.json", "step2_eval": cli[2], "step2_json": tmp / "run2.json",
            "ckpt2_eval": cli[3], "ckpt2_json": tmp / "ckpt2.json"}


@pytest.mark.slow
def test_validation_loss_is_exact_across_layouts_and_tracked(two_ranks):
    cp2, _ = two_ranks["cfgs"]
    a, b = two_ranks["runs"]
    out = Path(cp2.train.output_dir)
    assert [r["step"] for r in a] == [1, 2, 3]
    assert [("eval_loss" in r) for r in a] == [False, True, True]
    for x, y in zip(a, b):  # the same rows per step: the same training, the same validation
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert y.get("eval_loss", 0.0) == pytest.approx(x.get("eval_loss", 0.0), rel=1e-4)
    # by hand: every held-out row, plain transformers on the final weights
    rows = prepare_data(cp2.data, ByteTokenizer(), part="eval", seed=cp2.train.seed)
    assert len(rows) >= 2  # dp = 2 splits them (a filler evens out an odd count)
    model = eager_model(out / "final")
    losses = [loss for r in range(len(rows)) for _, loss in eager_losses(model, rows[r])]
    assert a[-1]["eval_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    # TensorBoard: every scalar of metrics.jsonl at its step; none where not asked for
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss", "perf/tokens_per_s",
            "perf/step_time_s", "perf/peak_memory_gib"} <= tags
    assert "perf/mfu" not in tags  # no MFU off a GPU (metrics.jsonl: null)
    for tag, key in (("train/loss", "loss"), ("eval/loss", "eval_loss"), ("train/lr", "lr"),
                     ("train/grad_norm", "grad_norm"), ("perf/tokens_per_s", "tokens_per_s"),
                     ("perf/attention_balance", "attention_balance")):
        want = [(r["step"], r[key]) for r in a if key in r]
        if not want:  # random texts: every row of a step may be part of one long document,
            assert tag not in tags  # with no boundary to balance, so no balance is logged
            continue
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)
    peaks = [e.value for e in events.Scalars("perf/peak_memory_gib")]
    assert peaks == pytest.approx([r["peak_memory_bytes"] / 2**30 for r in a], rel=1e-6)
    assert not list(Path(two_ranks["cfgs"][1].train.output_dir).glob("events.out.tfevents.*"))
    # lctrain eval on the run folder: its checkpoint, its validation rows, the same loss
    code, output = two_ranks["run_eval"]
    assert code == 0, output
    result = json.loads(two_ranks["run_json"].read_text())
    assert result["meta"]["step"] == 3 and result["meta"]["data_part"] == "eval"
    total = {r["bucket"]: r for r in result["rows"]}["all"]
    assert total["loss"] == pytest.approx(a[-1]["eval_loss"], rel=1e-5)
    assert total["tokens"] == sum(int((rows[r]["labels"] != -100).sum()) for r in range(len(rows)))
    # --step N: an older checkpoint of the run, the validation loss logged at that step
    code, output = two_ranks["step2_eval"]
    assert code == 0, output
    older = json.loads(two_ranks["step2_json"].read_text())
    assert older["meta"]["step"] == 2
    total = {r["bucket"]: r for r in older["rows"]}["all"]
    assert total["loss"] == pytest.approx(a[1]["eval_loss"], rel=1e-5)
    assert a[1]["eval_loss"] != a[2]["eval_loss"]  # the two checkpoints differ
    code, output = two_ranks["ckpt2_eval"]  # the checkpoint folder itself: the same
    assert code == 0, output
    assert json.loads(two_ranks["ckpt2_json"].read_text())["rows"] == older["rows"]


def test_missing_tensorboard_is_one_sentence(monkeypatch):
    import importlib.util

    from lctrain.errors import ConfigError
    from lctrain.train.tracking import check_report_to

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="tensorboard package is not installed; pip install"):
        check_report_to(load_recipe(None, []))
    check_report_to(load_recipe(None, ["train.report_to=[jsonl]"]))  # not asked for: fine


@pytest.mark.slow
def test_distributed_prefill_and_decode_match_one_process(two_ranks, model_folder):
    prompt, steps = two_ranks["prompt"], two_ranks["steps"]
    model = eager_model(model_folder)
    for schedule in ("distflash", "zigzag"):
        tokens, logits = two_ranks["decoded"][schedule]
        assert two_ranks["decoded_1"][schedule][0] == tokens  # both ranks decoded alike
        with torch.no_grad():  # one process, the whole prompt and answer, eager attention
            want = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        for step in range(steps):
            torch.testing.assert_close(torch.tensor(logits[step]), want[step], rtol=1e-5,
                                       atol=1e-5)
            top = torch.topk(want[step], 2).values
            if top[0] - top[1] > 1e-3:  # a clear choice: greedy picked it
                assert tokens[step] == int(want[step].argmax())


def _ppl_rows(result):
    return {r["bucket"]: r for r in result["rows"]}


@pytest.mark.slow
def test_eval_ppl_cli_matches_transformers_by_bucket(two_ranks, model_folder):
    code, output = two_ranks["ppl"]
    assert code == 0, output
    assert output.startswith("bucket,")  # rank 0 shows the table (csv here) ...
    assert two_ranks["ppl_other_rank"] == (0, "")  # ... and rank 1 nothing
    got = _ppl_rows(json.loads(two_ranks["ppl_json"].read_text()))
    from transformers import AutoTokenizer

    rows = prepare_data(DataConfig(source=str(two_ranks["ppl_data"]), seq_len=256,
                                   tokenizer=None), AutoTokenizer.from_pretrained(model_folder))
    model = eager_model(model_folder)
    per_bucket: dict[int, list[float]] = {}
    for r in range(len(rows)):
        for position, loss in eager_losses(model, rows[r]):
            per_bucket.setdefault(min(position // 48, 5), []).append(loss)
    assert len(got) == 7  # ceil(256 / 48) = 6 buckets and "all"
    for b, row in enumerate(r for name, r in got.items() if name != "all"):
        assert (row["start"], row["stop"]) == (48 * b, min(48 * b + 48, 256))
        losses = per_bucket.get(b, [])
        assert row["tokens"] == len(losses)
        if losses:
            assert row["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5, abs=1e-5)
            assert row["ppl"] == pytest.approx(math.exp(row["loss"]), rel=1e-9)
    every = [x for losses in per_bucket.values() for x in losses]
    assert got["all"]["tokens"] == len(every) > 0
    assert got["all"]["loss"] == pytest.approx(sum(every) / len(every), rel=1e-5)


def test_eval_passkey_cli_end_to_end(tmp_path, model_folder):
    """Through the command as a user runs it: two self-launched ranks (cp 2) over gloo."""
    from lctrain.eval.passkey import parse_answer, passkey_cases, passkey_prompt
    from transformers import AutoTokenizer

    out, picture = tmp_path / "pk.json", tmp_path / "pk.png"
    result = runner.invoke(app, ["eval", str(model_folder), "--task", "passkey", "--cp", "2",
                                 "--lengths", "320,384", "--depths", "0,0.5,1", "--trials", "2",
                                 "--seed", "5", "--json", str(out), "--plot", str(picture)])
    assert result.exit_code == 0, result.output
    assert "Passkey retrieval" in result.output and "accuracy" in result.output
    assert picture.stat().st_size > 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq_len"], r["depth"]) for r in rows] == [
        (n, d) for n in (320, 384) for d in (0.0, 0.5, 1.0)]
    tok = AutoTokenizer.from_pretrained(model_folder)
    cases = iter(passkey_cases([320, 384], [0.0, 0.5, 1.0], 2, seed=5))
    for row in rows:
        for sample in row["samples"]:
            case = next(cases)
            assert sample["passkey"] == case.passkey
            assert sample["needle_start"] == passkey_prompt(tok, case.length, case.depth,
                                                            case.passkey).needle_start
            assert sample["parsed"] == parse_answer(sample["answer"])
            assert sample["correct"] == (sample["parsed"] == case.passkey)
        assert row["accuracy"] == sum(s["correct"] for s in row["samples"]) / 2


def test_passkey_answers_only_with_ids_the_tokenizer_can_write(tmp_path):
    """A model with more embeddings than its tokenizer has ids (the tiny recipe at 1,024
    against the byte tokenizer's 259): greedy decoding picks among the tokenizer's ids, so every
    answer decodes."""
    out = tmp_path / "pk.json"
    result = runner.invoke(app, ["eval", "tiny", "--task", "passkey", "--cp", "1", "--lengths",
                                 "256", "--depths", "0,1", "--json", str(out), "--set",
                                 "model.config.vocab_size=1024", "--set",
                                 f"train.output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(len(r["samples"]) == 1 for r in rows)


def test_self_launched_rank_entry(tmp_path, model_folder):
    """What ``python -m lctrain.eval`` runs in each self-launched rank, here as one rank."""
    from transformers import AutoTokenizer

    from lctrain.config import save_resolved
    from lctrain.eval.request import resolve
    from lctrain.eval.evaluate import worker_entry

    data = texts(tmp_path / "d.jsonl", 4, random.Random(random.randrange(2**31)))
    cfg, request = resolve(str(model_folder), task="ppl", cp=1, seq_len=128, data=str(data),
                           max_rows=2, overrides=[f"train.output_dir={tmp_path / 'out'}"])
    request = dataclasses.replace(request, result_file=str(tmp_path / "result.json"))
    (tmp_path / "request.json").write_text(request.to_json())
    args = ["--config", str(save_resolved(cfg, tmp_path / "recipe.yaml")), "--error-dir",
            str(tmp_path), "--request", str(tmp_path / "request.json")]
    assert worker_entry(args) == 0
    got = {r["bucket"]: r for r in json.loads((tmp_path / "result.json").read_text())["rows"]}
    rows = prepare_data(DataConfig(source=str(data), seq_len=128, tokenizer=None),
                        AutoTokenizer.from_pretrained(model_folder))
    model = eager_model(model_folder)
    losses = [loss for r in range(2) for _, loss in eager_losses(model, rows[r])]
    assert got["all"]["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_eval_mistakes_are_one_sentence(tmp_path, model_folder):
    cases = [
        (["eval", str(tmp_path), "--task", "ppl"], "neither config.yaml"),
        (["eval", str(model_folder), "--step", "3"], "--step 3 needs a run folder"),
        (["eval", str(model_folder), "--task", "passkey", "--lengths", "301", "--cp", "2"],
         "passkey length 301 is not divisible by 2"),
        (["eval", str(model_folder), "--task", "passkey", "--depths", "0,x"],
         "'x' is not a number"),
        (["eval", str(model_folder), "--task", "passkey", "--depths", "0,1.5"], "outside [0, 1]"),
        (["eval", str(model_folder), "--task", "passkey", "--lengths", "64"], "too short"),
        (["eval", str(model_folder), "--plot", str(tmp_path / "p.txt")], "must end in one of"),
        (["eval", "tiny", "--set", "parallel.schedule=context_parallel"],
         "lctrain bench attention --peers"),
        (["eval", "tiny", "--task", "ppl", "--trials", "3"], "--trials is a setting of --task "
                                                             "passkey"),
        (["eval", "tiny", "--task", "passkey", "--bucket", "4k"], "--bucket is a setting of "
                                                                 "--task ppl"),
        (["eval", "tiny", "--task", "passkey", "--seq-len", "1k", "--lengths", "2k"],
         "--seq-len and --lengths both"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code != 0, args
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output


def test_progress_line_shows_eval_loss_and_eta(capsys):
    import time

    from lctrain.train.metrics import Progress

    record = {"loss": 2.5, "tokens_per_s": 1000.0, "step_time_s": 0.05, "lr": 1e-3, "mfu": None}
    progress = Progress(10, 0, enabled=True)
    time.sleep(0.05)
    progress.update(4, {**record, "eval_loss": 2.25})
    progress.update(10, record)
    first, last = capsys.readouterr().out.splitlines()
    assert first.startswith("step 4/10") and "eval loss 2.2500" in first
    value, unit = first.split("ETA ")[1].split()[:2]  # 6 steps left at the pace of 4 so far
    seconds = float(value) / (1e3 if unit == "ms" else 1.0)
    assert unit in ("ms", "s") and 1.5 * 0.05 <= seconds < 10
    assert "ETA" not in last and "eval loss" not in last  # done; not evaluated at this step


def test_a_peft_adapter_without_tokenizer_files_scores_as_its_merged_base(tmp_path, model_folder):
    """Most peft adapters ship no tokenizer: the base model's is used (the merged copy the ranks
    load has none), and the scores are plain transformers' on the base merged with the adapter."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = tmp_path / "adapter"
    torch.manual_seed(random.randrange(2**31))
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_folder),
                   LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                              init_lora_weights=False)).save_pretrained(adapter)
    assert not any(adapter.glob("tokenizer*"))
    data, out = texts(tmp_path / "d.jsonl", 4, random.Random(random.randrange(2**31))), \
        tmp_path / "a.json"
    result = runner.invoke(app, ["eval", str(adapter), "--task", "ppl", "--cp", "1", "--seq-len",
                                 "128", "--max-rows", "2", "--data", str(data), "--json", str(out)])
    assert result.exit_code == 0, result.output
    got = json.loads(out.read_text())["rows"][-1]
    rows = prepare_data(DataConfig(source=str(data), seq_len=128, tokenizer=None),
                        AutoTokenizer.from_pretrained(model_folder))
    merged = PeftModel.from_pretrained(eager_model(model_folder), adapter).merge_and_unload()
    losses = [loss for r in range(2) for _, loss in eager_losses(merged.eval(), rows[r])]
    assert got["bucket"] == "all" and got["tokens"] == len(losses)
    assert got["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
