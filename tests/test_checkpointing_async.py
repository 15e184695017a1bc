"""Checkpoints written in the background (one process): the state saved is the state of the
step that asked for it, even though the optimizer goes on at once (its step waits for the
host copy); at most one save is in flight (the next save waits for the previous one to be
written and published); the end of the run waits for the last; and the background saves give
the same checkpoint, bit for bit, as synchronous ones — also where torch's stager can stage only
once (torch 2.11 closes its copier after each staging: a second save through it would fail with
``KeyError: <class 'type'>``), so every save gets a stager of its own."""
from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager

from lctrain.checkpoint import writer as checkpoint_writer
from lctrain.checkpoint.reader import list_checkpoints, load_checkpoint
from lctrain.checkpoint.writer import Checkpointer


def _model():
    torch.manual_seed(7)
    module = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512))
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2)


def _step(module, optimizer, step: int) -> None:
    _grads(module, step)
    optimizer.step()


def _grads(module, step: int) -> None:
    for p in module.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))


def _snapshot(module, optimizer) -> list[torch.Tensor]:
    out = []
    for p in module.parameters():
        state = optimizer.state[p]
        out += [p.detach().clone(), *(state[k].clone() for k in sorted(state))]
    return out


def _state(step: int) -> dict:
    return {"step": step, "rows_consumed": step, "tokens_consumed": step, "seq_len": 1,
            "rows_per_step": 1, "layout": {"dp": 1, "cp": 1, "world_size": 1},
            "lr_plan": {"warmup_steps": 0, "total_steps": 9, "min_lr_ratio": 0.1,
                        "anchor_step": None, "anchor_value": None}}


def _loaded(path) -> list[torch.Tensor]:
    module, optimizer = _model()
    load_checkpoint(path, module=module, optimizer=optimizer)
    return _snapshot(module, optimizer)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(params=["reusable", "stages-once"])
def stager(request, monkeypatch):
    """The stager as this torch has it, or as torch 2.11's: closed after its first staging."""
    if request.param == "stages-once":
        stage = DefaultStager._stage

        def stage_then_close(self, state_dict, **kwargs):
            staged = stage(self, state_dict, **kwargs)
            self._state_dict_stager.close()
            return staged

        monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    checkpoint_writer._stager_reusable.cache_clear()
    yield request.param
    checkpoint_writer._stager_reusable.cache_clear()


def test_background_saves_hold_their_steps_state(tmp_path, stager):
    assert checkpoint_writer._stager_reusable() == (stager == "reusable")
    snapshots = {}
    for background in (True, False):
        module, optimizer = _model()
        saver = Checkpointer(tmp_path / str(background), module=module, optimizer=optimizer,
                             keep=3, asynchronous=background)
        for step in (1, 2, 3):
            _step(module, optimizer, step)
            snapshots[background, step] = _snapshot(module, optimizer)
            _grads(module, 10 + step)
            saver.save(step, _state(step))
            optimizer.step()  # at once: training goes on while the save runs
            if background and step == 2:  # saving 2 waited for 1: written and published
                assert [s for s, _ in list_checkpoints(tmp_path / "True")] == [1]
        assert saver.close() == (tmp_path / str(background) / "step-00000003" if background
                                 else None)
    for background in (True, False):
        saved = list_checkpoints(tmp_path / str(background))
        assert [s for s, _ in saved] == [1, 2, 3]
        for step, path in saved:
            assert _equal(_loaded(path), snapshots[background, step]), (background, step)
    assert all(_equal(snapshots[True, s], snapshots[False, s]) for s in (1, 2, 3))


def test_bench_step_times_steps_with_a_save_in_flight(tmp_path):
    """``lctrain bench step --save-every 2``: every other step saves (in the foreground on a
    CPU), and the row says how long the loop waited for the saves."""
    from lctrain.bench.step import run
    from lctrain.config import load_recipe

    cfg = load_recipe(None, ["parallel.cp=1", "data.max_documents=8", "train.warmup_steps=0"],
                      seq_len=64, output_dir=str(tmp_path / "bench"))
    (row,) = run(cfg, steps=4, nproc=1, warmup=1, save_every=2).rows
    assert row["status"] == "ok" and row["steps"] == 4 and row["save_every"] == 2
    assert 0 < row["checkpoint_s"] < row["step_time_s"] * 100
    assert row["step_after_save_s"] > 0 and row["step_without_save_s"] > 0
    assert not (tmp_path / "bench").exists()  # the scratch run, its saves and its folder are gone


def test_bench_step_splits_the_steps_after_a_save_from_the_others():
    """Saves after steps 2 and 4 of 6, one warm-up step: steps 3 and 5 ran after a save
    started; 2, 4 and 6 did not; the wait is the median over the timed saves."""
    from lctrain.bench.step import _saves

    times = {s: random.uniform(1, 2) for s in range(1, 7)}
    waits = {2: random.uniform(0, 1), 4: random.uniform(0, 1)}
    records = [{"step": s, "step_time_s": t, **({"checkpoint_s": waits[s]} if s in waits else {})}
               for s, t in times.items()]
    got = _saves(records, [r for r in records if r["step"] > 1], save_every=2)
    assert got["checkpoint_s"] == pytest.approx((waits[2] + waits[4]) / 2)
    assert got["step_after_save_s"] == pytest.approx((times[3] + times[5]) / 2)
    assert got["step_without_save_s"] == pytest.approx(sorted([times[2], times[4], times[6]])[1])
