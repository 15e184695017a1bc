"""The launcher's watch over its ranks. ``python -m lctrain.launch.supervisor FAILURES.json
[torch.distributed.run args]`` is the agent (`agent_main`), which writes the failed ranks' exit
codes to FAILURES.json; the `Supervisor` passes stop signals on, ends the other ranks after one
failed, and keeps the workers' stderr (copied into their log) in memory too, so a full disk does
not silence it; `report` says why the run ended."""
from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from lctrain.errors import UserError
from lctrain.launch.failures import explain, read_failures, read_records, relay, relayed
from lctrain.launch.lifetime import alive, children, die_with_launcher, signal_name
from lctrain.launch.stopping import (LAUNCHER_REQUEST, STOP_SIGNALS, catches_request,
                                    watched_signals)
from lctrain.launch.watchdog import heartbeat_dir, read_heartbeats, write_json


def agent_main(argv: list[str]) -> int:
    """Run torch.distributed.run with ``argv[1:]``; returns 0, or 1 when a rank failed."""
    die_with_launcher(levels=1)
    for sig in STOP_SIGNALS:  # the launcher's to handle; not SIG_IGN, which ranks would inherit
        signal.signal(sig, lambda signum, frame: None)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    failures_path, args = argv[0], parse_args(argv[1:])
    args.signals_to_handle = "SIGQUIT"  # torch's launcher would install handlers for them
    try:
        run(args)
    except ChildFailedError as error:
        failures = {str(rank): {"pid": f.pid, "exitcode": f.exitcode, "local_rank": f.local_rank}
                    for rank, f in error.failures.items()}
        if not write_json(Path(failures_path), failures):
            relay("failures", failures)
        return 1
    return 0


class Supervisor:
    """Watch the ``agent`` (`agent_main`) and its ranks (error records and stop file in
    ``launch_dir``); a rank that recorded a failure may live ``record_wait`` more seconds."""

    def __init__(self, agent: subprocess.Popen, launch_dir: Path, *, on_signal_text: str,
                 record_wait: float = 60.0, log: Path | None = None) -> None:
        self.agent, self.text, self.record_wait = agent, on_signal_text, record_wait
        self.errors, self.request = launch_dir / "errors", launch_dir / "stop"
        self.signals: list[int] = []
        self.signalled: set[int] = set()  # ranks the stop signal was passed to
        self.killed: set[int] = set()  # ranks killed here (not a cause of failure)
        self._kill_at: float | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=15)  # the log's last lines
        self.relayed: dict[str, list[dict]] = {"record": [], "failures": []}
        self.log_error: str | None = None  # why the log could not be written
        self.reader = None  # the thread copying the agent's stderr
        if agent.stderr is not None:
            self.reader = threading.Thread(target=self._copy_stderr, args=(log,), daemon=True)
            self.reader.start()

    def records(self) -> list[dict]:
        """The ranks' error records: those in files and those `relayed`, earliest first."""
        found = [*self.relayed["record"], *read_records(self.errors)]  # a file beats its relay
        unique = {(r.get("rank"), r.get("time")): r for r in found}
        return sorted(unique.values(), key=lambda r: r["time"])

    def _copy_stderr(self, log: Path | None) -> None:
        sink = None
        try:
            sink = open(log, "wb") if log is not None else None
        except OSError as error:
            self.log_error = error.strerror
        for line in iter(self.agent.stderr.readline, b""):
            text = line.decode(errors="replace").rstrip("\n")
            witness = relayed(text)
            if witness is not None:
                self.relayed.setdefault(witness[0], []).append(witness[1])
            else:
                self.tail.append(text)
            if sink is not None:
                try:
                    sink.write(line)
                    sink.flush()
                except OSError as error:  # a full disk: the lines stay in memory
                    self.log_error = error.strerror
                    sink = None
        self.agent.stderr.close()
        if sink is not None:
            try:
                sink.close()
            except OSError as error:
                self.log_error = error.strerror

    def wait(self) -> int | None:
        """Block until the agent ends; returns None when it ended by itself (see
        ``agent.returncode``), or 128 + the signal when a second stop signal killed every rank."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self._on_signal) for sig in watched_signals()}
        try:
            while True:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.agent.wait(timeout=0.2)
                    return None
                if len(self.signals) > 1:
                    self._kill(children(self.agent.pid) + [self.agent.pid])
                    self.agent.wait()
                    return 128 + self.signals[1]
                if self.signals:
                    self._pass_on()
                self._watch_failures()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        if len(self.signals) == 1:
            with contextlib.suppress(OSError):  # a full disk: the ranks stop on SIGTERM's behalf
                self.request.write_text(f"{signum}\n")
            print(f"lctrain: {signal_name(signum)} received; {self.text}", file=sys.stderr,
                  flush=True)

    def _pass_on(self) -> None:
        for pid in children(self.agent.pid):
            if pid not in self.signalled and catches_request(pid):
                self.signalled.add(pid)
                _send(pid, LAUNCHER_REQUEST)

    def _watch_failures(self) -> None:
        now = time.time()
        if self._kill_at is None:
            for record in self.records():
                if not alive(record.get("pid", 0)):  # the others get 3 s to end by themselves
                    self._kill_at = now + 3.0
                elif now - record["time"] > self.record_wait:
                    self._kill_at = now
        if self._kill_at is not None and now >= self._kill_at:
            self._kill(children(self.agent.pid))

    def _kill(self, pids: list[int]) -> None:
        for pid in pids:
            self.killed.add(pid)
            _send(pid, signal.SIGKILL)


def _send(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def last_completed_step(output_dir: Path) -> int | None:
    """The last step the run completed, from the heartbeats and rank 0's last metrics line;
    None before the ranks reached training (the metrics may be an earlier run's)."""
    steps = [b["completed"] for b in read_heartbeats(heartbeat_dir(output_dir)).values()]
    if not steps:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError, KeyError):
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
        steps.append(json.loads(lines[-1])["step"])
    return max(steps)


def report(supervisor: Supervisor, *, launch_dir: Path, failures: Path, log: Path,
           checkpoint_hint: str) -> int:
    """Say why the ranks ended (after `Supervisor.wait`); returns the launcher's exit code.
    ``checkpoint_hint`` is a clause: where the last checkpoint is and how to resume. A rank's
    error, a hang, or a rank killed by a signal is a one-sentence UserError."""
    code = supervisor.agent.returncode
    if code == 0:
        return 0
    if supervisor.reader is not None:  # the rest of the agent's stderr (a process the ranks
        supervisor.reader.join(5.0)  # left behind may hold the pipe open, hence the timeout)
    relayed_failures = (supervisor.relayed["failures"] or [None])[-1]
    outcome = explain(supervisor.records(), read_failures(failures, relayed_failures),
                      killed=supervisor.killed, last_step=last_completed_step(launch_dir.parent))
    if outcome.kind == "user":
        raise UserError(outcome.message)
    if outcome.kind in ("hang", "environment"):
        raise UserError(f"{outcome.message} The job was stopped; {checkpoint_hint}.")
    if outcome.kind == "signal":
        raise UserError(f"{outcome.message}; the job was stopped; {checkpoint_hint}.")
    kept = (f"the workers' log is {log}" if supervisor.log_error is None else
            f"the workers' log {log} could not be written ({supervisor.log_error})")
    if outcome.kind == "bug":
        print(outcome.message, file=sys.stderr)
        print(f"({kept})", file=sys.stderr)
        return 1
    if outcome.kind == "stopped":
        return outcome.exit_code
    print("\n".join(supervisor.tail), file=sys.stderr)
    print(f"training failed (exit code {code}); {kept}", file=sys.stderr)
    return code or 1


if __name__ == "__main__":
    code = agent_main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the ranks have ended; torch's teardown would only cost time
