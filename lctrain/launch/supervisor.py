"""The launcher's watch over its ranks, from the start of torch.distributed.run to its report.

`Supervisor.wait` blocks until the agent (`lctrain.launch.agent`) ends, polling every `POLL_S`:

- a stop signal (SIGTERM, SIGINT, SIGHUP) on the launcher is passed on to every rank (the agent's
  children) as a request (`lctrain.launch.stopping.LAUNCHER_REQUEST`, the signal's number in
  ``.launch/stop``); the ranks stop together after their current step; a second signal kills
  every rank and the agent at once and returns 128 + its number;
- once a rank has recorded a failure (`lctrain.launch.failures.record_error`) and exited, the
  remaining ranks get `KILL_GRACE_S` seconds to end by themselves, then SIGKILL: a stopped rank
  never does, and torch.distributed.run would wait 30 s before its own SIGKILL. A record
  whose rank stays alive (on NCCL, a hang report waits for torch's timeout to dump the flight
  recorder) starts the same count after ``record_wait`` seconds.

`report` turns the witnesses into what the user reads: a rank's error, the rank a signal killed
and the last step, or the hang and the ranks that did not arrive, with where the last complete
checkpoint is and the command that resumes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lctrain.errors import UserError
from lctrain.launch.failures import explain, read_failures, read_records
from lctrain.launch.lifetime import alive, children, signal_name
from lctrain.launch.stopping import LAUNCHER_REQUEST, catches_request, watched_signals
from lctrain.launch.watchdog import read_heartbeats

POLL_S = 0.2
"""How often the launcher looks at its ranks."""
KILL_GRACE_S = 3.0
"""Seconds the other ranks get to end by themselves after a rank failed and exited."""


class Supervisor:
    """Watch the agent process ``agent`` and its ranks (see the module docstring).

    Args:
        agent: the running ``python -m lctrain.launch.agent`` process.
        launch_dir: ``output_dir/.launch``: the ranks' error records (``errors/``) and the stop
            request file (``stop``).
        on_signal_text: what to say when a stop signal arrives (the launcher's stderr).
        record_wait: seconds a rank that recorded a failure may stay alive before the others
            are killed anyway.
    """

    def __init__(self, agent: subprocess.Popen, launch_dir: Path, *, on_signal_text: str,
                 record_wait: float = 60.0) -> None:
        self.agent, self.text, self.record_wait = agent, on_signal_text, record_wait
        self.errors, self.request = launch_dir / "errors", launch_dir / "stop"
        self.signals: list[int] = []
        self.signalled: set[int] = set()  # ranks the stop signal was passed to
        self.killed: set[int] = set()  # ranks killed here (not a cause of failure)
        self._kill_at: float | None = None

    def wait(self) -> int | None:
        """Block until the agent ends.

        Returns:
            None when the agent ended by itself (its exit code is ``agent.returncode``), or
            128 + the signal when a second stop signal made this process kill every rank.
        """
        previous = self._install()
        try:
            while True:
                try:
                    self.agent.wait(timeout=POLL_S)
                    return None
                except subprocess.TimeoutExpired:
                    pass
                if len(self.signals) > 1:
                    self._kill(children(self.agent.pid) + [self.agent.pid])
                    self.agent.wait()
                    return 128 + self.signals[1]
                if self.signals:
                    self._pass_on(self.signals[0])
                self._watch_failures()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _install(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in watched_signals()}

    def _on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        if len(self.signals) == 1:
            self.request.write_text(f"{signum}\n")
            print(f"lctrain: {signal_name(signum)} received; {self.text}", file=sys.stderr,
                  flush=True)

    def _pass_on(self, signum: int) -> None:
        for pid in children(self.agent.pid):
            if pid not in self.signalled and catches_request(pid):
                self.signalled.add(pid)
                _send(pid, LAUNCHER_REQUEST)

    def _watch_failures(self) -> None:
        now = time.time()
        if self._kill_at is None:
            for record in read_records(self.errors):
                if not alive(record.get("pid", 0)):
                    self._kill_at = now + KILL_GRACE_S
                elif now - record["time"] > self.record_wait:
                    self._kill_at = now
        if self._kill_at is not None and now >= self._kill_at:
            self._kill(children(self.agent.pid))

    def _kill(self, pids: list[int]) -> None:
        for pid in pids:
            self.killed.add(pid)
            _send(pid, signal.SIGKILL)


def _send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def last_completed_step(output_dir: Path) -> int | None:
    """The last step the run completed: the newest of the ranks' heartbeats and rank 0's last
    metrics line (written just before its heartbeat says so); None before the ranks reached
    training (the metrics may then still be those of an earlier run)."""
    steps = [b["completed"] for b in read_heartbeats(output_dir / ".launch" / "ranks").values()]
    if not steps:
        return None
    try:
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
        steps.append(json.loads(lines[-1])["step"])
    except (OSError, ValueError, IndexError, KeyError):
        pass
    return max(steps, default=None)


def report(supervisor: Supervisor, *, launch_dir: Path, failures: Path, log: Path,
           checkpoint_hint: str) -> int:
    """Say why the ranks ended; returns the launcher's exit code.

    Args:
        supervisor: the supervisor that watched the run (after `Supervisor.wait`).
        launch_dir: ``output_dir/.launch`` (error records, heartbeats).
        failures: the agent's failures file.
        log: the workers' log.
        checkpoint_hint: where the last complete checkpoint is and how to resume (a clause).

    Raises:
        UserError: a rank's error, a hang, or a rank killed by a signal, as one sentence.
    """
    code = supervisor.agent.returncode
    if code == 0:
        return 0
    records = read_records(launch_dir / "errors")
    outcome = explain(records, read_failures(failures), killed=supervisor.killed,
                      last_step=last_completed_step(launch_dir.parent))
    if outcome.kind == "user":
        raise UserError(outcome.message)
    if outcome.kind == "hang":
        raise UserError(f"{outcome.message} The job was stopped; {checkpoint_hint}.")
    if outcome.kind == "signal":
        raise UserError(f"{outcome.message}; the job was stopped; {checkpoint_hint}.")
    if outcome.kind == "bug":
        print(outcome.message, file=sys.stderr)
        print(f"(the workers' log is {log})", file=sys.stderr)
        return 1
    if outcome.kind == "stopped":
        return outcome.exit_code
    tail = log.read_text(errors="replace").strip().splitlines()[-15:]
    print("\n".join(tail), file=sys.stderr)
    print(f"training failed (exit code {code}); the workers' log is {log}", file=sys.stderr)
    return code or 1
