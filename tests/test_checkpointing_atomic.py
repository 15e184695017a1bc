"""Checkpoints under SIGKILL and SIGTERM: a process that saves a checkpoint after every
optimizer step (in turn synchronously and in the background) is killed at random moments of its
save loop, over and over; each new process resumes from the newest complete checkpoint. After
every kill, every checkpoint that carries a name loads and holds exactly the state of its step
(replayed independently here), the newest step never goes back, and the kills do land inside
writes (a ``.tmp-`` folder is left). SIGTERM, the polite stop, instead lets the write in flight
finish: the process stops after publishing the step it was saving, and nothing half-written is
left.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import torch

from conftest import SESSION_SEED

KILLS = 10


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    module = torch.nn.Sequential(torch.nn.Linear(192, 192), torch.nn.Linear(192, 96))
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)


def _step(module, optimizer, step: int) -> None:
    """One optimizer step with gradients that depend on the step alone."""
    for i, p in enumerate(module.parameters()):
        p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (i + 1) + step
                           ).reshape(p.shape)
    optimizer.step()


def _fingerprint(module, optimizer) -> str:
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().numpy().tobytes())
        for value in optimizer.state[p].values():
            digest.update(value.numpy().tobytes())
    return digest.hexdigest()


def _state(step: int) -> dict:
    return {"step": step, "rows_consumed": step, "tokens_consumed": 8 * step, "seq_len": 8,
            "rows_per_step": 1, "layout": {"dp": 1, "cp": 1, "world_size": 1},
            "lr_plan": {"warmup_steps": 0, "total_steps": 10**6, "min_lr_ratio": 0.1,
                        "anchor_step": None, "anchor_value": None}}


def _save_forever(root: Path, store: str, asynchronous: bool) -> None:
    """The killed process: resume from the newest checkpoint, then train and save each step."""
    import torch.distributed as dist

    from lctrain.checkpoint.reader import latest_checkpoint, load_checkpoint
    from lctrain.checkpoint.writer import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    module, optimizer = _model()
    step = 0
    latest = latest_checkpoint(root)
    if latest is not None:
        step = load_checkpoint(latest, module=module, optimizer=optimizer)["step"]
    saver = Checkpointer(root, module=module, optimizer=optimizer, keep=2,
                         asynchronous=asynchronous)
    deadline = time.time() + 60  # never outlive a dead test
    while time.time() < deadline:
        step += 1
        _step(module, optimizer, step)
        saver.save(step, _state(step))


def _save_until_stopped(root: Path, store: str, asynchronous: bool, report: Path) -> int:
    """The signalled process: as `_save_forever`, but a stop signal (`StopRequest`, as training
    ranks have) ends the loop after the save in progress; returns 128 + the signal."""
    import torch.distributed as dist

    from lctrain.checkpoint.reader import latest_checkpoint, load_checkpoint
    from lctrain.checkpoint.writer import Checkpointer
    from lctrain.launch.stopping import StopRequest

    with StopRequest() as stop:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        module, optimizer = _model()
        latest = latest_checkpoint(root)
        step = 0 if latest is None else load_checkpoint(latest, module=module,
                                                        optimizer=optimizer)["step"]
        saver = Checkpointer(root, module=module, optimizer=optimizer, keep=2,
                             asynchronous=asynchronous)
        deadline = time.time() + 60  # never outlive a dead test
        while not stop.signum and time.time() < deadline:
            step += 1
            _step(module, optimizer, step)
            saver.save(step, _state(step))
        saver.close()  # a background save is published before the process ends
        report.write_text(str(step))
        return 128 + stop.signum


def _replay(steps: int) -> dict[int, str]:
    module, optimizer = _model()
    prints = {}
    for step in range(1, steps + 1):
        _step(module, optimizer, step)
        prints[step] = _fingerprint(module, optimizer)
    return prints


def _loaded(path: Path) -> tuple[int, str]:
    from lctrain.checkpoint.reader import load_checkpoint

    module, optimizer = _model()
    step = load_checkpoint(path, module=module, optimizer=optimizer)["step"]
    return step, _fingerprint(module, optimizer)


def _child(name: str, *args) -> None:
    """The body of a spawned child: run the function ``name`` of this module and exit with
    what it returns (0 for None)."""
    code = 1
    try:
        code = globals()[name](*args) or 0
    finally:
        os._exit(code)


def _spawn(name: str, *args) -> int:
    """Start ``name(*args)`` in a fresh interpreter and return its pid. Not a fork: a forked
    child inherits pytest's threads' locks, and one held at the fork now and then hung the
    child before its first save."""
    proc = multiprocessing.get_context("spawn").Process(target=_child, args=(name, *args))
    proc.start()
    return proc.pid


def _wait_for_progress(root: Path, newest: int, pid: int) -> None:
    """Wait until the child has published a checkpoint past ``newest`` (it is in its loop)."""
    from lctrain.checkpoint.reader import list_checkpoints

    deadline = time.time() + 60
    while time.time() < deadline:
        found = list_checkpoints(root)
        if found and found[-1][0] > newest:
            return
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            raise AssertionError("the saving process ended by itself")
        time.sleep(0.01)
    raise AssertionError("the saving process published nothing in 60 s")


def test_kill_9_during_writes_never_leaves_a_checkpoint_that_resume_would_pick(tmp_path):
    from lctrain.checkpoint.reader import list_checkpoints

    rng = random.Random(SESSION_SEED)
    root, newest, mid_write, seen = tmp_path / "checkpoints", 0, 0, {}
    for kill in range(KILLS):
        store = tempfile.mktemp(dir=tmp_path, prefix="store-")
        pid = _spawn("_save_forever", root, store, kill % 2 == 1)
        _wait_for_progress(root, newest, pid)
        time.sleep(rng.uniform(0.0, 0.5))  # a random moment of the save loop
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        mid_write += any(root.glob(".tmp-step-*"))
        found = list_checkpoints(root)
        assert found, f"kill {kill}: no complete checkpoint at all"
        for step, path in found:
            if step not in seen:
                seen[step] = _loaded(path)
        assert found[-1][0] >= newest, f"kill {kill}: the newest checkpoint went back"
        newest = found[-1][0]
    reference = _replay(max(seen))
    for step, (loaded_step, fingerprint) in seen.items():
        assert loaded_step == step and fingerprint == reference[step], f"step {step} differs"
    assert newest >= KILLS  # each process published at least one step
    assert mid_write >= 1  # kills landed inside writes, not only between them


def test_a_training_run_killed_while_saving_resumes_to_the_same_losses(tmp_path):
    """A real run (tiny recipe, one process, a save after every step) killed with SIGKILL at a
    random moment after its third save, then resumed with --resume, logs exactly the losses of
    the same run left alone."""
    import json
    import subprocess
    import sys

    from typer.testing import CliRunner

    from lctrain.cli import app
    from lctrain.checkpoint.reader import list_checkpoints

    sets = ["--nproc", "1", "--set", "parallel.cp=1", "--seq-len", "64", "--max-steps", "6",
            "--set", "data.max_documents=8", "--set", "checkpoint.every=1",
            "--set", "checkpoint.keep=2", "--set", "checkpoint.export_final=false"]
    killed, alone = tmp_path / "killed", tmp_path / "alone"
    child = subprocess.Popen([sys.executable, "-m", "lctrain", "finetune", *sets,
                              "--output-dir", str(killed)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and child.poll() is None:
            found = list_checkpoints(killed / "checkpoints")
            if found and found[-1][0] >= 3:
                break
            time.sleep(0.01)
        time.sleep(random.Random(SESSION_SEED).uniform(0.0, 0.3))
    finally:
        child.kill()
        child.wait()
    resumed_from = list_checkpoints(killed / "checkpoints")[-1][0]
    assert 3 <= resumed_from <= 6
    for folder, extra in ((killed, ["--resume"]), (alone, [])):
        result = CliRunner().invoke(app, ["finetune", *sets, "--output-dir", str(folder), *extra])
        assert result.exit_code == 0, result.output

    def losses(folder):
        return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl")
                                                  .read_text().splitlines())}

    straight, after = losses(alone), losses(killed)
    assert sorted(after) == list(range(1, 7))  # the log keeps the steps before the kill
    for step in range(resumed_from + 1, 7):
        assert after[step] == straight[step]  # bit for bit: the same computation


def test_sigterm_during_writes_finishes_the_save_in_flight_then_stops(tmp_path):
    from lctrain.checkpoint.reader import list_checkpoints

    rng = random.Random(SESSION_SEED + 1)
    root, newest, seen = tmp_path / "checkpoints", 0, {}
    for term in range(6):
        store = tempfile.mktemp(dir=tmp_path, prefix="store-")
        report = tmp_path / f"stopped-{term}"
        pid = _spawn("_save_until_stopped", root, store, term % 2 == 1, report)
        _wait_for_progress(root, newest, pid)
        time.sleep(rng.uniform(0.0, 0.3))  # a random moment of the save loop
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGTERM
        assert not list(root.glob(".tmp-step-*")), f"stop {term}: a write was left half done"
        found = list_checkpoints(root)
        assert found[-1][0] == int(report.read_text()), f"stop {term}: the last save is missing"
        for step, path in found:
            if step not in seen:
                seen[step] = _loaded(path)
        newest = found[-1][0]
    reference = _replay(max(seen))
    for step, (loaded_step, fingerprint) in seen.items():
        assert loaded_step == step and fingerprint == reference[step], f"step {step} differs"
