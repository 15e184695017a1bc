"""Whole training runs through the runner on two gloo ranks (the embedded tiny recipe, shrunk).

- cp = 2 (one sequence split over both ranks, 2 micro-batches accumulated), dp = 2 (cp = 1, each
  rank its own sequence) and cp = 2 under FSDP2 consume the same rows per step, so their per-step
  losses must agree (they are one computation, up to float rounding);
- 6 steps straight == 3 steps, then --resume from that checkpoint to 6 (exact resume; dropout
  on every layer's output draws from the RNG state that the checkpoint must restore);
- checkpoints rotate to the last K and a stale half-written one is ignored and cleared.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lctrain.config import load_recipe
from spawn import run_on_ranks

FIELDS = {"step", "loss", "tokens", "tokens_per_s", "step_time_s", "lr", "grad_norm", "time",
          "peak_memory_bytes", "mfu"}


def _cfg(out: Path, **sets):
    base = {"data.seq_len": 128, "data.max_documents": 24, "train.max_steps": 3,
            "train.warmup_steps": 1, "train.loss_chunk_tokens": 48, "train.lr": 3e-3,
            "parallel.attention_backend": "reference", "parallel.cp": 2, "train.grad_accum": 2,
            "parallel.fsdp": "off"}
    base.update(sets)
    return load_recipe(None, [f"{k}={v}" for k, v in base.items()], output_dir=str(out))


def _metrics(cfg) -> list[dict]:
    path = Path(cfg.train.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_all(rank, world, cfgs):
    from lctrain.train.runner import run_worker

    results = []
    for cfg in cfgs:
        assert run_worker(cfg) == 0
        results.append(_metrics(cfg) if rank == 0 else None)
    return results


def test_cp2_dp2_and_fsdp_losses_agree(tmp_path):
    cfgs = [_cfg(tmp_path / "cp2"),
            _cfg(tmp_path / "dp2", **{"parallel.cp": 1, "train.grad_accum": 1}),
            _cfg(tmp_path / "fsdp", **{"parallel.fsdp": "on"})]
    cp2, dp2, fsdp = run_on_ranks(_run_all, 2, cfgs)[0]
    assert [r["step"] for r in cp2] == [1, 2, 3]
    # the first step's record also counts the attention forwards: one per layer and micro-step
    assert cp2[0]["attention_forward_calls"] == 2 * 2
    for record in cp2:
        assert set(record) - {"attention_forward_calls", "attention_balance"} == FIELDS
        assert record.get("attention_balance", 1.0) >= 1.0  # with rows of several documents
        assert record["tokens"] == 2 * 128 and record["tokens_per_s"] > 0
        assert record["peak_memory_bytes"] > 0 and record["mfu"] is None  # CPU: no MFU
    assert cp2[0]["lr"] == pytest.approx(3e-3)  # one warm-up step reaches the peak rate
    # AdamW's steps hardly change with the gradients' scale (nor do clipped ones): the gradient
    # norms, taken before clipping, must agree as well as the losses
    for a, b, c in zip(cp2, dp2, fsdp):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert c["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert c["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    saved = json.loads((tmp_path / "cp2" / "checkpoints" / "step-00000003" / "trainer.json")
                       .read_text())
    assert {k: saved[k] for k in ("step", "rows_consumed", "tokens_consumed", "rows_per_step",
                                  "layout")} == {
        "step": 3, "rows_consumed": 6, "tokens_consumed": 6 * 128, "rows_per_step": 2,
        "layout": {"dp": 1, "cp": 2, "world_size": 2}}
    assert load_recipe(tmp_path / "cp2" / "config.yaml") == cfgs[0]  # the recipe as given


def _hidden_dropout(p: float) -> None:
    """Dropout on every Llama decoder layer's output in this process (Llama has no hidden
    dropout of its own, and lctrain refuses attention dropout), so each step draws from the RNG."""
    import torch.nn.functional as F
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaDecoderLayer.forward

    def dropped(self, *args, **kwargs):
        return F.dropout(forward(self, *args, **kwargs), p, self.training)

    modeling_llama.LlamaDecoderLayer.forward = dropped


def _straight_then_resume(rank, world, straight, resumed):
    import torch.distributed as dist

    from lctrain.train.runner import run_worker

    _hidden_dropout(0.1)
    run_worker(straight)
    if rank == 0:
        src = Path(straight.train.output_dir) / "checkpoints"
        dst = Path(resumed.train.output_dir) / "checkpoints"
        shutil.copytree(src / "step-00000003", dst / "step-00000003")
        shutil.copy(src.parent / "config.yaml", dst.parent / "config.yaml")  # the run's recipe
        (dst / ".tmp-step-00000009").mkdir()  # a save that crashed half-way
    dist.barrier()
    run_worker(resumed, resume=True)
    if rank != 0:
        return None
    listing = sorted(p.name for p in (Path(resumed.train.output_dir) / "checkpoints").iterdir())
    return _metrics(straight), _metrics(resumed), listing


def test_resume_is_exact_and_checkpoints_rotate(tmp_path):
    common = {"train.max_steps": 6, "parallel.fsdp": "on", "checkpoint.keep": 2}
    straight = _cfg(tmp_path / "a", **common, **{"checkpoint.every": 3})
    resumed = _cfg(tmp_path / "b", **common, **{"checkpoint.every": 1})
    full, tail, listing = run_on_ranks(_straight_then_resume, 2, straight, resumed)[0]
    assert [r["step"] for r in tail] == [4, 5, 6]
    for a, b in zip(full[3:], tail):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)
    assert full[-1]["loss"] < full[0]["loss"]
    assert listing == ["step-00000005", "step-00000006"]  # last K = 2 kept, stale tmp cleared
    kept_a = sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir())
    assert kept_a == ["step-00000003", "step-00000006"]


def test_checkpoint_listing_ignores_incomplete(tmp_path):
    from lctrain.checkpoint.reader import latest_checkpoint, list_checkpoints

    for name in ("step-00000002", "step-00000010", ".tmp-step-00000011", "step-3", "notes"):
        (tmp_path / name).mkdir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 10]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010"
    assert latest_checkpoint(tmp_path / "missing") is None
