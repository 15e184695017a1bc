"""Work kept when the machine around a run fails it, caused for real on self-launched two-rank
CPU runs (gloo, the tiny recipe, shrunk):

1. its output goes away — a pipe whose reader is closed, then SIGINT (``| tee`` and Ctrl-C), and
   a terminal that hangs up (the kernel's SIGHUP, then EIO on every write): every rank stops
   after the same step and saves it, the launcher exits 128 + the signal, and the sentences the
   terminal missed are in ``.launch/terminal.log``;
2. a tampered checkpoint ``.metadata`` is refused on --resume in the sentence export gives;
3. its disk fills (a small tmpfs, where the machine lets a test mount one), at a save and
   mid-run: the error names "No space left on device", the path and the last complete
   checkpoint, which stays intact, though the workers' log is on the same full disk.
"""
from __future__ import annotations

import fcntl
import json
import os
import pickle
import pty
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from fault_tools import fill, leftovers

from lctrain.checkpoint.reader import list_checkpoints, read_model_weights, read_trainer_state

SETS = {"data.seq_len": 128, "data.max_documents": 24, "parallel.attention_backend": "reference",
        "train.loss_chunk_tokens": 48, "checkpoint.export_final": False}
BOUND_S = 120.0


def _command(out: Path, *extra: str, resume: bool = False) -> list[str]:
    sets = [arg for key, value in SETS.items() for arg in ("--set", f"{key}={value}")]
    start = [str(out / "config.yaml"), "--resume"] if resume else ["--output-dir", str(out), *sets]
    return [sys.executable, "-m", "lctrain", "finetune", *start, *extra]


def _steps(out: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in
                (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    except OSError:
        return []


def _wait(condition, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _completed(out: Path) -> int:
    """The last step rank 0's heartbeat says it completed (0: none yet)."""
    try:
        return json.loads((out / ".launch" / "ranks" / "rank0.json").read_text())["completed"]
    except (OSError, ValueError):
        return 0


def _hint(out: Path) -> str:
    step, path = list_checkpoints(out / "checkpoints")[-1]
    return (f"the last complete checkpoint is {path} (step {step}); resume with: lctrain finetune "
            f"{out / 'config.yaml'} --resume")


def _stopped(out: Path, code: int, signum: int, total: int) -> None:
    """What a run stopped by ``signum`` after its output went away leaves behind."""
    stopped = max(_steps(out))
    text = (out / ".launch" / "terminal.log").read_text()
    name = signal.Signals(signum).name
    assert code == 128 + signum, text
    assert f"lctrain: {name} received; the ranks finish their current step and save a " \
           "checkpoint, then stop" in text, text
    assert f"stopped by {name} after step {stopped} of {total}; {_hint(out)}\n" in text, text
    assert list_checkpoints(out / "checkpoints")[-1][0] == stopped  # saved on the signal
    beats = [json.loads((out / ".launch" / "ranks" / f"rank{r}.json").read_text())
             for r in (0, 1)]
    assert [beat["completed"] for beat in beats] == [stopped, stopped]  # the same step
    _wait(lambda: not leftovers(out), "the ranks to end", timeout=10)


def _closed_pipe_then_sigint(out: Path) -> None:
    reader, writer = os.pipe()
    launcher = subprocess.Popen(_command(out, "--max-steps", "400", "--set",
                                         "checkpoint.every=100"),
                                stdout=writer, stderr=writer, cwd=out.parent)
    os.close(writer)
    _wait(lambda: len(_steps(out)) >= 2, "step 2")
    os.close(reader)  # the reader goes away; the ranks' next progress lines fail
    closed = len(_steps(out))
    _wait(lambda: len(_steps(out)) >= closed + 2, "two steps after the close")
    launcher.send_signal(signal.SIGINT)
    _stopped(out, launcher.wait(timeout=BOUND_S), signal.SIGINT, 400)


def _terminal_hangs_up(out: Path) -> None:
    """The resumed run on a terminal of its own (a pseudo-terminal it controls) that closes."""
    start = max(_steps(out))
    master, slave = pty.openpty()

    def own_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    launcher = subprocess.Popen(_command(out, resume=True), stdin=slave, stdout=slave,
                                stderr=slave, cwd=out.parent, preexec_fn=own_terminal)
    os.close(slave)
    shown = []

    def read():  # the terminal shows what it gets until it closes
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                return
            if not chunk:
                return
            shown.append(chunk)

    threading.Thread(target=read, daemon=True).start()
    _wait(lambda: max(_steps(out)) >= start + 2, "the resumed loop")
    os.close(master)  # the terminal closes: the kernel sends SIGHUP, writes get EIO
    _stopped(out, launcher.wait(timeout=BOUND_S), signal.SIGHUP, 400)
    assert b"lctrain finetune: " in b"".join(shown)  # it did show the run until then


def _cli_error(command: list[str], cwd: Path) -> str:
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return errors[0]


class _Evil:
    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return os.system, (f"touch {self.mark}",)


def _tampered_metadata(out: Path, tmp_path: Path) -> None:
    mark = tmp_path / "PWNED"
    _, newest = list_checkpoints(out / "checkpoints")[-1]
    (newest / ".metadata").write_bytes(pickle.dumps(_Evil(mark)))
    resumed = _cli_error(_command(out, resume=True), out.parent)
    exported = _cli_error([sys.executable, "-m", "lctrain", "export", str(out), "--output",
                           str(tmp_path / "exported")], out.parent)
    assert resumed == exported == (
        f"error: {newest / '.metadata'} is not a checkpoint's metadata as lctrain writes it "
        "(refusing to load posix.system); it was altered or comes from another program, and "
        "lctrain does not load it")
    assert not mark.exists()


def test_a_run_outlives_its_output_and_refuses_a_tampered_checkpoint(tmp_path):
    out = tmp_path / "run"
    _closed_pipe_then_sigint(out)
    _terminal_hangs_up(out)
    _tampered_metadata(out, tmp_path)


def test_a_full_disk_names_its_cause_and_keeps_the_last_checkpoint(tmp_path):
    """A 2.6 MB disk holds one checkpoint (1.7 MB) of the tiny run, not two: the save of step
    4 fails. Resumed, the disk is filled mid-run: the next write of rank 0 fails (metrics or
    TensorBoard events)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(disk)],
                           capture_output=True)
    if mount.returncode:
        pytest.skip("mounting a tmpfs needs privileges this machine does not give")
    out, names = disk / "run", ["model.embed_tokens.weight", "lm_head.weight"]
    try:
        error = _cli_error(_command(out, "--max-steps", "40", "--set", "checkpoint.every=2",
                                    "--set", "checkpoint.keep=2"), tmp_path)
        ckpts = out / "checkpoints"
        assert error.startswith(f"error: writing the checkpoint of step 4 to "
                                f"{ckpts / '.tmp-step-00000004'} failed ("), error
        assert "No space left on device" in error
        assert error.endswith(f"; the last complete checkpoint, {ckpts / 'step-00000002'} (step "
                              "2), is untouched — free space or fix the folder's permissions, "
                              "then resume with --resume."), error
        assert not list(ckpts.glob(".tmp-step-*"))  # the partial one is removed: space again
        kept = read_model_weights(ckpts / "step-00000002", names)
        assert not leftovers(out)

        for beat in (out / ".launch" / "ranks").glob("*.json"):  # the previous run's
            beat.unlink()
        launcher = subprocess.Popen(_command(out, "--set", "checkpoint.every=100", resume=True),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=tmp_path)
        _wait(lambda: _completed(out) >= 4, "the resumed loop")
        fill(disk)
        _, stderr = launcher.communicate(timeout=BOUND_S)
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert launcher.returncode == 1 and len(errors) == 1, stderr
        assert errors[0].startswith(f"error: No space left on device ({out}/"), errors[0]
        assert errors[0].endswith("); free space on that disk, or choose another "
                                  f"train.output_dir. The job was stopped; {_hint(out)}."), errors
        assert "workers' log" not in stderr and "Traceback" not in stderr
        assert read_trainer_state(ckpts / "step-00000002")["step"] == 2  # intact
        assert [step for step, _ in list_checkpoints(ckpts)] == [2]
        again = read_model_weights(ckpts / "step-00000002", names)
        assert all((again[name] == kept[name]).all() for name in names)
        assert not leftovers(out)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)
