"""Faults caused for real on self-launched two-rank CPU runs (gloo, the tiny recipe, shrunk).

One run folder lives through a chain of faults, each run resuming from what the previous one
left, the first resume with the exact command the previous run printed:

1. rank 1 is SIGKILLed (what an out-of-memory kill looks like) or gets SIGSEGV (a crashed
   kernel or extension), chosen at random, while a second run into the same folder is refused;
   the job ends with the rank, the signal, the last step and the last checkpoint named;
2. SIGTERM on rank 1 alone: both ranks stop after the same step, save a checkpoint
   (no regular save falls there), rank 0 says how to resume; exit 143;
3. SIGTERM or SIGINT (Ctrl-C) on a launcher process at a random moment of a resumed run that
   saves every step: exit 128 + the signal,
   the checkpoint of the stopped step complete, no half-written one left;
4. ``kill -9`` on a launcher process as soon as its ranks are up (each asks for its
   parent-death signal first thing, so what holds then holds at any later moment): the agent
   and both ranks die with it, and the folder's lock with them; its private temporary folder
   is left, and the next launcher removes it;
5. SIGSTOP on rank 1: after train.collective_timeout rank 0 names the operation and rank 1, the
   launcher ends the job, the last checkpoint is untouched.

The first run's losses up to the kill are the uninterrupted reference: every step redone after
a resume — from a regular checkpoint, and from the one saved on the signal — must give exactly
its loss. Each fault asserts the message, the exit code, a time bound and that no process of
the run is left. The launcher's second signal is tested on real processes without training in
test_faults_units.py. A second scenario trains with a
learning rate that makes the loss NaN, then goes on with every step skipped.
"""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe
from lctrain.errors import UserError
from lctrain.train import finetune
from lctrain.checkpoint.reader import list_checkpoints, read_model_weights
from lctrain.launch.lifetime import children, describe_death
from lctrain.launch.stopping import catches_request
from fault_tools import leftovers

SETS = {"data.seq_len": 128, "data.max_documents": 24, "parallel.attention_backend": "reference",
        "train.loss_chunk_tokens": 48, "train.warmup_steps": 2, "train.min_lr_ratio": 1.0,
        "checkpoint.every": 5, "checkpoint.keep": 2, "checkpoint.export_final": False}
BOUND_S = 60.0  # the README's bound for a dead or stopped rank to end the job (CPU, this recipe)


def _cfg(out: Path, max_steps: int, **sets):
    merged = {**SETS, **sets}
    return load_recipe(None, [f"{k}={v}" for k, v in merged.items()], output_dir=str(out),
                       max_steps=max_steps)


def _steps(out: Path) -> dict[int, dict]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {}
    records = [json.loads(line) for line in lines if line.endswith("}")]
    return {r["step"]: r for r in records}


def _beat(out: Path, rank: int) -> dict:
    try:
        return json.loads((out / ".launch" / "ranks" / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(condition, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _fresh(out: Path) -> None:
    """Forget the heartbeats of the previous run (the launcher clears them too, but later)."""
    for path in (out / ".launch" / "ranks").glob("*.json"):
        path.unlink()


def _training(out: Path, step: int) -> bool:
    """Both ranks are in (or past) ``step`` of this run's loop."""
    return all(_beat(out, r).get("step", 0) >= step for r in (0, 1))


def _newest(out: Path) -> tuple[int, Path]:
    return list_checkpoints(out / "checkpoints")[-1]


def _hint(out: Path) -> str:
    step, path = _newest(out)
    return (f"the last complete checkpoint is {path} (step {step}); resume with: lctrain finetune "
            f"{out / 'config.yaml'} --resume")


def _in_background(action) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def _kill_rank_1(out: Path, cfg, refused: list) -> int:
    """Step 1: a second run into the folder is refused; then rank 1 is SIGKILLed or crashes."""
    ended, signum = {}, random.choice([signal.SIGKILL, signal.SIGSEGV])

    def inject():
        _wait(lambda: max(_steps(out), default=0) >= 2, "step 2")
        try:
            finetune(cfg, nproc=2)
        except UserError as error:
            refused.append(str(error))
        _wait(lambda: max(_steps(out), default=0) >= 16, "step 16")
        ended["pid"] = _beat(out, 1)["pid"]
        os.kill(ended["pid"], signum)
        ended["at"] = time.monotonic()

    thread = _in_background(inject)
    with pytest.raises(UserError) as error:
        finetune(cfg, nproc=2)
    assert time.monotonic() - ended["at"] < BOUND_S
    thread.join()
    last = max(_steps(out))
    assert str(error.value) == (
        f"rank 1 (pid {ended['pid']}) {describe_death(signum)} after step {last}, the last step "
        f"the job completed; the job was stopped; {_hint(out)}.")
    return last


def _private_folders(pid: int) -> list[Path]:
    """The private temporary folders whose owner file names process ``pid``."""
    found = []
    for folder in Path(tempfile.gettempdir()).glob("lctrain-launch-*"):
        try:
            if (folder / "owner").read_text().split()[0] == str(pid):
                found.append(folder)
        except (OSError, IndexError):
            continue
    return found


def _kill_launcher(out: Path, log: Path) -> int:
    """Step 4: ``kill -9`` on a launcher process once both of its ranks are up; its pid."""
    _fresh(out)
    with log.open("w") as sink:
        launcher = subprocess.Popen([sys.executable, "-m", "lctrain", "finetune",
                                     str(out / "config.yaml"), "--resume"], stdout=sink,
                                    stderr=subprocess.STDOUT, cwd=out.parent)

        def ranks_up():
            agents = children(launcher.pid)
            ranks = [pid for agent in agents for pid in children(agent)]
            return len(ranks) == 2 and all(catches_request(pid) for pid in ranks)

        _wait(ranks_up, "the ranks to start")
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        _wait(lambda: not leftovers(out), "the ranks to die with the launcher", timeout=10)
    assert time.monotonic() - killed < 10
    assert len(_private_folders(launcher.pid)) == 1  # left behind, for the next launcher
    return launcher.pid


def _term_rank_1(out: Path, capfd) -> int:
    """Step 2: the printed command, in this process; SIGTERM on rank 1 only."""
    start = _newest(out)[0]

    def terminate():
        _wait(lambda: _training(out, start + 1), "the resumed loop")
        os.kill(_beat(out, 1)["pid"], signal.SIGTERM)

    command = shlex.split(f"lctrain finetune {out / 'config.yaml'} --resume")
    _fresh(out)
    capfd.readouterr()
    thread = _in_background(terminate)
    result = CliRunner().invoke(app, command[1:])
    thread.join()
    stopped = max(_steps(out))
    ranks = capfd.readouterr().out  # rank 0 writes to this process's stdout
    assert result.exit_code == 143, result.output
    assert f"\nstopped by SIGTERM after step {stopped} of 30; {_hint(out)}\n" in ranks
    assert _newest(out)[0] == stopped and stopped % 10 != 0  # saved because of the signal
    assert all(_beat(out, r)["completed"] == stopped for r in (0, 1))  # the same step
    return stopped


def _stop_launcher(out: Path, log: Path) -> None:
    """Step 3: SIGTERM (``kill PID``, a scheduler's preemption) or SIGINT (Ctrl-C) on a launcher
    process at a random moment of a run that saves every step (in the background, as on GPUs,
    `test_checkpointing_atomic` stops the writer itself)."""
    start = _newest(out)[0]
    signum = random.choice([signal.SIGTERM, signal.SIGINT])
    _fresh(out)
    with log.open("w") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "lctrain", "finetune", str(out / "config.yaml"), "--resume",
             "--set", "checkpoint.every=1", "--max-steps", "40"],  # room for the next faults, however late this stop lands
            stdout=sink, stderr=subprocess.STDOUT, cwd=out.parent)
        _wait(lambda: _training(out, start + random.randint(1, 3)), "the resumed loop")
        time.sleep(random.uniform(0.0, 0.3))
        launcher.send_signal(signum)
        code = launcher.wait(timeout=BOUND_S)
    text = log.read_text()
    stopped = max(_steps(out))
    assert code == 128 + signum, text
    assert f"stopped by {signal.Signals(signum).name} after step {stopped} of 40; " in text, text
    assert _newest(out)[0] == stopped  # every step is saved; the last one before the exit
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    _wait(lambda: not leftovers(out), "the ranks to end", timeout=10)


def _stop_rank_1(out: Path) -> None:
    """Step 5: SIGSTOP on rank 1; the watchdog of rank 0 names it."""
    start = _newest(out)[0]
    cfg = load_recipe(out / "config.yaml", ["train.collective_timeout=5"])
    stopped = {}

    def freeze():
        _wait(lambda: _training(out, start + 2), "the resumed loop")
        stopped["pid"] = _beat(out, 1)["pid"]
        os.kill(stopped["pid"], signal.SIGSTOP)
        stopped["at"] = time.monotonic()

    _fresh(out)
    thread = _in_background(freeze)
    with pytest.raises(UserError) as error:
        finetune(cfg, resume=True, nproc=2)
    assert time.monotonic() - stopped["at"] < 5 + BOUND_S
    thread.join()
    message = str(error.value)
    waited = re.match(r"rank 0 waited (\d+) s in the ", message)
    assert waited and 5 <= int(waited[1]) <= 10, message  # the timeout, plus the beat's delay
    assert "(train.collective_timeout is 5 s); these ranks did not arrive: rank 1 (pid " \
           f"{stopped['pid']} on {os.uname().nodename}: no heartbeat for " in message
    assert ", so it is stopped, frozen or dead; last seen " in message
    assert message.endswith(f"). The job was stopped; {_hint(out)}.")
    assert _newest(out)[0] <= max(_steps(out))


def test_a_run_survives_a_chain_of_faults_and_resumes_exactly(tmp_path, capfd):
    out = tmp_path / "run"
    refused = []
    # checkpoints every 10 steps: the kill lands after step 16 and, unless 4 steps late, before
    # step 20, so the run resumes from step 10; the signal's checkpoint falls at 11 or 12 (at
    # 16, 5 steps late, no reference step would be left beyond it to redo)
    _kill_rank_1(out, _cfg(out, 30, **{"checkpoint.every": 10}), refused)
    assert refused == [f"{out} is in use by another lctrain run (pid {os.getpid()} on "
                       f"{os.uname().nodename}); wait for it to finish or stop it, or choose "
                       "another train.output_dir."]
    reference = _steps(out)  # uninterrupted from step 1
    assert not leftovers(out)
    terminated = _term_rank_1(out, capfd)
    assert not leftovers(out)
    _stop_launcher(out, tmp_path / "stopped.log")
    killed = _kill_launcher(out, tmp_path / "killed.log")
    _stop_rank_1(out)
    assert not _private_folders(killed)  # the next launcher removed it
    assert not leftovers(out)
    final = _steps(out)
    redone = [step for step in reference if step in final and step > 10]
    assert any(step > terminated for step in redone), "no step after the signal's checkpoint"
    for step in sorted(set(reference) & set(final)):  # every step redone after a resume, exactly
        assert final[step]["loss"] == reference[step]["loss"], step
        assert final[step]["lr"] == reference[step]["lr"], step


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, capfd):
    """lr = 1e10: step 1 throws the weights far out, every later loss is NaN. The updates are
    skipped (weights, optimizer and schedule unchanged), three in a row end the run, and every
    checkpoint kept is of the last good weights; the checkpoints of skipped steps never rotate
    out step 1's, the last of a step that trained. Resumed with a limit far away, the run
    skips every step, ends, and its last line says so."""
    out = tmp_path / "nan"
    cfg = _cfg(out, 12, **{"train.lr": 1e10, "train.max_nonfinite_steps": 3, "checkpoint.every": 1,
                           "checkpoint.keep": 1})
    with pytest.raises(UserError) as error:
        finetune(cfg, nproc=2)
    steps = _steps(out)
    assert sorted(steps) == [1, 2, 3, 4]
    assert steps[1]["loss"] is not None and "skipped_steps" not in steps[1]
    for step in (2, 3, 4):
        assert steps[step]["loss"] is None and steps[step]["skipped_steps"] == 1
        assert steps[step]["lr"] == steps[2]["lr"]  # the warm-up does not advance
    assert steps[2]["lr"] == 2 * steps[1]["lr"]
    assert str(error.value) == (
        "3 steps in a row up to step 4 had a non-finite loss or gradient norm "
        "(train.max_nonfinite_steps is 3): their updates were skipped and the run stopped (a "
        "learning rate too high for this model, train.lr, is the usual cause); "
        f"{_hint(out)}.")
    saved = list_checkpoints(out / "checkpoints")
    assert [s for s, _ in saved] == [1, 3]  # checkpoint.keep is 1, but step 1 trained
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight"]
    weights = [read_model_weights(path, names) for _, path in saved]
    for name in names:
        assert weights[0][name].isfinite().all() and weights[0][name].abs().max() > 1e3
        assert all((w[name] == weights[0][name]).all() for w in weights[1:])
    assert not leftovers(out)
    capfd.readouterr()
    resumed = load_recipe(out / "config.yaml", ["train.max_nonfinite_steps=50"], max_steps=6)
    assert finetune(resumed, resume=True, nproc=2) == 0
    ranks = capfd.readouterr().out  # rank 0 writes to this process's stdout
    assert ("\ndone: step 6/6, loss nan -> nan; 3 of the 3 steps run had a non-finite loss or "
            "gradient norm and were skipped (their updates not applied); metrics, config and "
            f"checkpoints in {out}\n") in ranks, ranks
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [1, 6]
    assert not leftovers(out)


def test_a_diverged_run_waits_for_its_background_save_before_naming_the_checkpoint(
        tmp_path, monkeypatch):
    """Saves in the background (as on a GPU), each published a second late: the run that stops
    on non-finite steps first lands the save in flight (step 3), then names it."""
    from lctrain.checkpoint import writer
    from lctrain.train import runner

    publish = writer.publish
    monkeypatch.setattr(writer, "publish", lambda *a, **k: (time.sleep(1.0), publish(*a, **k)))
    make = runner.make_checkpointer

    def background(setup, trainer):
        saver = make(setup, trainer)
        saver.asynchronous = True
        return saver

    monkeypatch.setattr(runner, "make_checkpointer", background)
    out = tmp_path / "nan"
    cfg = _cfg(out, 12, **{"train.lr": 1e10, "train.max_nonfinite_steps": 3, "checkpoint.every": 1,
                           "checkpoint.keep": 1, "parallel.cp": 1})
    with pytest.raises(UserError) as error:
        finetune(cfg, nproc=1)
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [1, 3]
    assert str(error.value).endswith(f"{_hint(out)}."), str(error.value)
    assert "(step 3)" in str(error.value)
    assert not leftovers(out)
