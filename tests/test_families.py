"""Real model families from local Hugging Face folders, and RoPE scaling, across cp ranks.

One spawn of two gloo ranks (`_worker`) serves both tests of this file:

- every family of `model_folders` (a tiny random model saved with ``save_pretrained``, with its
  own BPE tokenizer) trains two steps through the runner at dp = 2 (cp = 1) and at cp = 2 with
  distflash and/or zigzag, consuming the same two packed rows per step (cp accumulates two
  micro-batches): the per-step losses must agree, and the first step's must equal the loss of
  transformers' own eager model loaded with plain ``from_pretrained`` from the same folder, on
  the same rows, each packed document run on its own (fp32, 1e-5 relative);
- a Llama-3.1-style folder, loaded with RoPE overrides (rope_theta, linear, yarn, llama3,
  dynamic; old and new spellings) on top, runs packed documents sharded over the two ranks under
  distflash, zigzag and ring: every rank's logits must equal its shard of plain transformers'
  eager logits, computed document by document from a folder whose config.json was edited by hand
  to the expected RoPE settings. Positions are global and restart per document.
"""
from __future__ import annotations

import json
import shutil
from itertools import islice
from pathlib import Path

import pytest
import torch

from model_folders import FAMILIES, make_model_folder
from spawn import run_on_ranks

SEQ = 128
VARIANTS = {"dp2": {"parallel.cp": 1, "train.grad_accum": 1},
            "cp2": {"parallel.cp": 2, "train.grad_accum": 2},
            "zigzag": {"parallel.cp": 2, "train.grad_accum": 2, "parallel.schedule": "zigzag"}}
RUNS = {"llama2": ("dp2", "cp2"), "llama3": ("dp2", "cp2", "zigzag"), "mistral": ("dp2", "zigzag"),
        "qwen2": ("dp2", "cp2"), "qwen3": ("dp2", "zigzag"), "gpt2": ("dp2", "cp2")}
"""The variants each family trains: every family at cp = 1 and cp = 2, under both layouts
(contiguous and zigzag) across the families (each run costs a few seconds on two CPU cores)."""

ROPE_SEQ = 256
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
ROPE_CASES = {  # name: (model.config overrides, expected rope_parameters, max_position_embeddings)
    "rope_theta": ({"rope_theta": 2e6}, {**LLAMA3_ROPE, "rope_theta": 2e6}, 512),
    "linear": ({"rope_parameters": {"rope_type": "linear", "factor": 4.0}},
               {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}, 512),
    "yarn": ({"rope_scaling": {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 64},
              "max_position_embeddings": 1024},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
              "rope_theta": 500000.0}, 1024),
    "llama3": ({"rope_parameters": {"factor": 32.0}, "max_position_embeddings": 2048},
               {**LLAMA3_ROPE, "factor": 32.0}, 2048),
    "dynamic": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
                {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500000.0}, 512),
}
SCHEDULES = ("distflash", "zigzag", "ring")


def _documents(path: Path, count: int) -> Path:
    """``count`` short documents (40–120 characters of Python's help topics) as JSON lines: each
    shorter than a row, so every row holds a document boundary."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics)[40:60])
    lengths = torch.randint(40, 120, (count,)).tolist()
    starts = torch.randint(0, len(text) - 400, (count,)).tolist()
    path.write_text("".join(json.dumps({"text": text[s:s + n]}) + "\n"
                            for s, n in zip(starts, lengths)))
    return path


def _recipe(folder: Path, data: Path, out: Path, **sets):
    from lctrain.config import load_recipe

    base = {"model.path": folder, "model.config": "null", "data.tokenizer": "null",
            "data.source": data, "train.max_steps": 2, "train.warmup_steps": 0,
            "train.lr": 1e-3, "train.loss_chunk_tokens": 48, "checkpoint.keep": 0,
            "parallel.attention_backend": "reference", "parallel.fsdp": "off", **sets}
    return load_recipe(None, [f"{k}={v}" for k, v in base.items()], seq_len=SEQ,
                       output_dir=str(out))


def _worker(rank, world, cfgs, rope_folder, ids, positions, cu):
    return _train_all(rank, cfgs), _rope_logits(world, rope_folder, ids, positions, cu)


def _train_all(rank, cfgs):
    from lctrain.train.runner import run_worker

    losses = []
    for cfg in cfgs:
        assert run_worker(cfg) == 0
        lines = (Path(cfg.train.output_dir) / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(line)["loss"] for line in lines] if rank == 0 else None)
    return losses


def _rope_logits(world, folder, ids, positions, cu):
    """{(case, schedule): this rank's logits} and {case: the loaded model's RoPE config}."""
    from lctrain.model import CPContext, load_model
    from lctrain_kernels.distributed import make_schedule, shard

    pg = torch.distributed.group.WORLD
    logits, configs = {}, {}
    for case, (overrides, _, _) in ROPE_CASES.items():
        model = load_model(str(folder), config=overrides, seed=0, seq_len=ROPE_SEQ, cp=world)
        configs[case] = (model.config.rope_parameters, model.config.max_position_embeddings)
        for schedule in SCHEDULES:
            layout = make_schedule(world, schedule).layout
            ctx = CPContext(group=pg, cu_seqlens=cu, schedule=schedule, backend="reference")
            local = [shard(t, group=pg, layout=layout, dim=1) for t in (ids, positions)]
            with torch.no_grad():
                out = model(input_ids=local[0], position_ids=local[1], cp_context=ctx).logits
            logits[(case, schedule)] = out.numpy()  # numpy: a tensor's storage dies with us
    return logits, configs


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Everything the two ranks compute, in one spawn (imports cost more than the runs)."""
    tmp = tmp_path_factory.mktemp("families")
    data = _documents(tmp / "docs.jsonl", 40)
    seed = int(torch.randint(0, 2**31, ()))
    folders = {f: make_model_folder(tmp / "models", f, seed=seed) for f in FAMILIES}
    cfgs = {(f, v): _recipe(folders[f], data, tmp / "runs" / f / v, **VARIANTS[v])
            for f in FAMILIES for v in RUNS[f]}
    cuts = sorted(torch.randperm(ROPE_SEQ - 1)[:4].add(1).tolist())
    bounds = [0, *cuts, ROPE_SEQ]
    ids = torch.randint(0, 400, (1, ROPE_SEQ))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]
    cu = torch.tensor(bounds, dtype=torch.int32)
    results = run_on_ranks(_worker, 2, list(cfgs.values()), folders["llama3"], ids, positions, cu)
    losses, (_, configs) = results[0]
    return {"folders": folders, "cfgs": cfgs, "losses": dict(zip(cfgs, losses)), "tmp": tmp,
            "rope": (ids, bounds), "logits": [rope[0] for _, rope in results],
            "configs": configs}


def eager_losses(folder: Path, cfg, rows: int) -> tuple[float, float]:
    """Mean token loss of plain transformers (eager attention) on the first step's ``rows`` rows:
    with each attention segment of a row (a packed document piece) run on its own with its own
    positions 0..n-1, and — to show that this matters — with each row run as one sequence."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lctrain.data import iter_batches, prepare_data

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    dataset = prepare_data(cfg.data, AutoTokenizer.from_pretrained(folder))
    totals, count = [0.0, 0.0], 0
    for batch in islice(iter_batches(dataset, batch_size=1, dp_rank=0, dp_size=1,
                                     seed=cfg.train.seed, grad_accum=rows), rows):
        count += int((batch.labels != -100).sum())
        # a row that holds one piece of one document has no cu_seqlens
        for which, bounds in enumerate((batch.cu_seqlens or (0, SEQ), (0, SEQ))):
            for start, stop in zip(bounds[:-1], bounds[1:]):
                ids, labels = batch.input_ids[:, start:stop], batch.labels[:, start:stop]
                with torch.no_grad():
                    logits = model(input_ids=ids,
                                   position_ids=torch.arange(stop - start)[None]).logits
                totals[which] += float(torch.nn.functional.cross_entropy(
                    logits[0].double(), labels[0], ignore_index=-100, reduction="sum"))
    return totals[0] / count, totals[1] / count


def test_every_family_trains_alike_at_cp1_cp2_zigzag_and_matches_transformers(ranks):
    documents_matter = []
    for family in FAMILIES:
        runs = {v: ranks["losses"][(family, v)] for v in RUNS[family]}
        assert all(len(r) == 2 for r in runs.values()), (family, runs)
        for variant in RUNS[family][1:]:
            assert runs[variant][0] == pytest.approx(runs["dp2"][0], rel=1e-5), (family, runs)
            assert runs[variant][1] == pytest.approx(runs["dp2"][1], rel=1e-4), (family, runs)
        want, whole_rows = eager_losses(ranks["folders"][family],
                                        ranks["cfgs"][(family, "dp2")], rows=2)
        assert runs["dp2"][0] == pytest.approx(want, rel=1e-5), (family, runs, want)
        documents_matter.append(abs(whole_rows - want) / want)
    # the comparison has teeth: ignoring the document masks moves the loss by far more than 1e-5
    # (by 1e-4 to 3e-2 relative per family; the largest of six is always above 2e-3)
    assert max(documents_matter) > 2e-3, documents_matter


def _edited_by_hand(folder: Path, dest: Path, rope: dict, max_positions: int) -> Path:
    """A copy of ``folder`` whose config.json states ``rope`` and ``max_positions`` directly."""
    shutil.copytree(folder, dest)
    config = json.loads((dest / "config.json").read_text())
    config.pop("rope_scaling", None)
    config.pop("rope_theta", None)
    config.update(rope_parameters=rope, max_position_embeddings=max_positions)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_rope_overrides_keep_global_positions_under_every_schedule(ranks):
    from transformers import AutoModelForCausalLM

    from lctrain_kernels.distributed import make_schedule, shard

    ids, bounds = ranks["rope"]
    per_rank = ranks["logits"]
    for case, (_, rope, max_positions) in ROPE_CASES.items():
        assert ranks["configs"][case] == (rope, max_positions), case
        folder = _edited_by_hand(ranks["folders"]["llama3"], ranks["tmp"] / f"rope-{case}", rope,
                                 max_positions)
        eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        with torch.no_grad():  # document by document, positions 0..n-1 in each
            want = torch.cat([eager(input_ids=ids[:, a:b]).logits
                              for a, b in zip(bounds[:-1], bounds[1:])], dim=1)  # (1, S, V)
        for schedule in SCHEDULES:
            layout = make_schedule(2, schedule).layout
            for rank, logits in enumerate(per_rank):
                expect = shard(want, layout=layout, dim=1, rank=rank, world_size=2)
                got = torch.from_numpy(logits[(case, schedule)])
                # fp32 rounding of logits of standard deviation ~2: errors ~1e-5 anywhere
                assert (got - expect).abs().max() < 1e-4, (case, schedule, rank)
