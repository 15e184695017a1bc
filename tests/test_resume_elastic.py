"""Resume on another process layout, from background-written checkpoints, with another length.

Real runs of the tiny recipe (gloo, CPU) with the same global batch (2 rows per step):

- 4 steps at dp 1 × cp 2 (FSDP2, checkpoints written in the background) are resumed from step 2
  at cp 1 on one process (replicated): steps 3–4 give the uninterrupted run's losses — the
  model and AdamW states are resharded and the data stream continues at the same row;
- and back: 4 steps at cp 1 on one process (synchronous checkpoints), resumed from step 2 at
  dp 1 × cp 2 (FSDP2) and at dp 2 × cp 1 with grad_accum 1;
- resuming with --max-steps raised re-plans the cosine decay from the rate reached: the rate
  of the first resumed step is the one the run would have used, then it falls smoothly to the
  floor at the new end;
- a resume that would change the global batch is refused with the grad_accum that keeps it.

And the data position is global: for any dp × batch_size × grad_accum with the same global
batch, the rows a step takes from a position are the same rows.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from lctrain.config import load_recipe
from spawn import run_on_ranks


def _cfg(out: Path, **sets):
    base = {"data.seq_len": 128, "data.max_documents": 24, "train.max_steps": 4,
            "train.warmup_steps": 1, "train.loss_chunk_tokens": 48, "train.lr": 3e-3,
            "parallel.attention_backend": "reference", "parallel.cp": 2, "train.grad_accum": 2,
            "parallel.fsdp": "on", "checkpoint.every": 2, "checkpoint.keep": 2,
            "checkpoint.export_final": "false"}
    base.update(sets)
    return load_recipe(None, [f"{k}={v}" for k, v in base.items()], output_dir=str(out))


def _metrics(cfg) -> list[dict]:
    path = Path(cfg.train.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _from_step_2(cfg, into: Path) -> None:
    """A new folder holding ``cfg``'s run as it was at its step-2 checkpoint."""
    src = Path(cfg.train.output_dir)
    (into / "checkpoints").mkdir(parents=True)
    shutil.copy(src / "config.yaml", into / "config.yaml")
    shutil.copytree(src / "checkpoints" / "step-00000002", into / "checkpoints" / "step-00000002")


def _alone(cfg, resume: bool = False) -> list[dict]:
    from lctrain.train.runner import run_worker

    assert run_worker(cfg, resume=resume) == 0
    return _metrics(cfg)


def _in_the_background(setup, trainer):
    """The run's checkpointer, writing in the background as on GPUs."""
    import os

    from lctrain.checkpoint.writer import Checkpointer

    return Checkpointer(Path(setup.cfg.train.output_dir) / "checkpoints",
                        module=trainer.distributed.module, optimizer=trainer.optimizer,
                        keep=setup.cfg.checkpoint.keep, asynchronous=True,
                        local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _on_two_ranks(rank, world, first, resumed):
    from lctrain.train import runner

    saving = runner.make_checkpointer
    runner.make_checkpointer = _in_the_background  # the first run's saves
    runner.run_worker(first)
    runner.make_checkpointer = saving
    for cfg in resumed:
        runner.run_worker(cfg, resume=True)
    return [_metrics(c) for c in (first, *resumed)] if rank == 0 else None


def _same_losses(resumed: list[dict], straight: list[dict]) -> None:
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(straight[2:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-9)


def test_resume_on_another_layout_continues_the_same_run(tmp_path):
    one = _cfg(tmp_path / "one", **{"parallel.cp": 1, "parallel.fsdp": "off"})
    straight_one = _alone(one)
    two = _cfg(tmp_path / "two")
    _from_step_2(one, tmp_path / "one-at-cp2")
    _from_step_2(one, tmp_path / "one-at-dp2")
    resumed = [_cfg(tmp_path / "one-at-cp2"),
               _cfg(tmp_path / "one-at-dp2", **{"parallel.cp": 1, "train.grad_accum": 1})]
    straight_two, at_cp2, at_dp2 = run_on_ranks(_on_two_ranks, 2, two, resumed)[0]
    for a, b in zip(straight_one, straight_two):  # one computation on either layout
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    _same_losses(at_cp2, straight_one)
    _same_losses(at_dp2, straight_one)

    _from_step_2(two, tmp_path / "two-at-cp1")
    at_cp1 = _alone(_cfg(tmp_path / "two-at-cp1", **{"parallel.cp": 1, "parallel.fsdp": "off"}),
                    resume=True)
    _same_losses(at_cp1, straight_two)

    _from_step_2(two, tmp_path / "longer")
    longer = _alone(_cfg(tmp_path / "longer", **{"parallel.cp": 1, "parallel.fsdp": "off",
                                                 "train.max_steps": 6}), resume=True)
    rates = [r["lr"] for r in longer]
    assert rates[0] == pytest.approx(straight_two[2]["lr"], rel=1e-9)  # no jump at the resume
    floor, top = 0.1 * 3e-3, rates[0]
    for step, rate in zip(range(2, 6), rates):  # cosine from the rate reached at step 2 to 6
        assert rate == pytest.approx(floor + (top - floor) * 0.5 * (1 + math.cos(
            math.pi * (step - 2) / (6 - 2))), rel=1e-9)
    assert all(a > b for a, b in zip(rates, rates[1:]))

    _from_step_2(two, tmp_path / "other-batch")
    from lctrain.errors import UserError
    from lctrain.train.runner import run_worker

    with pytest.raises(UserError, match="took 2 rows per step but this run takes 1 .*"
                                        "set train.grad_accum=2 to keep it"):
        run_worker(_cfg(tmp_path / "other-batch", **{"parallel.cp": 1, "parallel.fsdp": "off",
                                                     "train.grad_accum": 1}), resume=True)


@pytest.mark.parametrize("before, after", [((1, 1, 4), (2, 1, 2)), ((2, 2, 1), (1, 1, 4)),
                                           ((4, 1, 1), (1, 2, 2)), ((2, 1, 2), (4, 1, 1))])
def test_the_data_position_is_global_rows(before, after):
    """(dp, batch_size, grad_accum) before and after a resume at step 3, same global batch;
    masked rows are grouped into steps by attention work (batch_size 1 only), plain ones not."""
    import numpy as np

    from lctrain.data import iter_batches, pack

    masked = before[1] == after[1] == 1
    cuts = np.sort(np.random.default_rng().choice(np.arange(1, 37 * 16), 60, replace=False))
    lengths = np.diff([0, *cuts, 37 * 16]) if masked else [16] * 37
    stream = np.random.default_rng().integers(1, 250, 37 * 16).tolist()
    bounds = np.cumsum([0, *lengths])
    rows = pack([stream[a:b] for a, b in zip(bounds[:-1], bounds[1:])], seq_len=16,
                document_mask=masked, pad_id=0)
    assert len(rows) == 37 and masked == (len(set(rows.attention_work().tolist())) > 1)

    def step_rows(layout, first_step: int, steps: int) -> list[list[tuple]]:
        dp, batch, accum = layout
        rows_consumed = first_step * dp * batch * accum
        streams = [iter_batches(rows, batch_size=batch, dp_rank=r, dp_size=dp, seed=5,
                                grad_accum=accum, start_step=rows_consumed // (dp * batch))
                   for r in range(dp)]
        out = []
        for _ in range(steps):
            taken = [tuple(row.tolist()) for s in streams for _ in range(accum)
                     for row in next(s).input_ids]
            out.append(sorted(taken))
        return out

    straight = step_rows(before, 0, 9)
    assert step_rows(before, 0, 3) + step_rows(after, 3, 6) == straight
    seen = [row for step in straight for row in step]
    assert len(set(seen)) == len(seen) == 36  # 9 steps × 4 rows, none twice within an epoch
