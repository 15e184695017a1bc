"""Hang detection: each rank's main thread marks its operation and step (`Watchdog.enter`), a
daemon thread writes heartbeat files, and an operation longer than ``train.collective_timeout``
is reported in one sentence naming the ranks that did not arrive."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


def heartbeat_dir(output_dir: str | os.PathLike) -> Path:
    """Where the ranks of the run in ``output_dir`` write their heartbeats."""
    return Path(output_dir) / ".launch" / "ranks"


def read_heartbeats(folder: str | os.PathLike) -> dict[int, dict]:
    """The heartbeat of every rank that wrote one: {rank: record}."""
    return {int(record["rank"]): record for record in read_rank_files(folder)}


def read_rank_files(folder: str | os.PathLike) -> list[dict]:
    """Every readable ``rank*.json`` in ``folder`` (heartbeats, error records)."""
    found = []
    for path in Path(folder).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):  # an unreadable one is left out
            found.append(json.loads(path.read_text()))
    return found


def write_json(path: Path, data: dict) -> bool:
    """Write ``data`` to ``path`` atomically (a temporary file renamed); False when it could not
    be written (a full disk)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        return False
    return True


@dataclass
class _Mark:
    """Where the main thread is: the operation (None: not watched), its step, since when."""

    operation: str | None = None
    step: int = 0  # the step being run (completed steps + 1)
    completed: int = 0
    since: float = 0.0  # time.monotonic() at entry


class Watchdog:
    """One rank's heartbeat and hang detector in ``folder`` (`heartbeat_dir`, shared by all
    ranks): after ``timeout`` seconds in one operation, ``on_hang`` is called from the
    watchdog thread with the one-sentence report, and should end the process."""

    def __init__(self, folder: str | os.PathLike, *, rank: int, world_size: int, timeout: float,
                 on_hang: Callable[[str], None]) -> None:
        self.folder = Path(folder)
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.on_hang = on_hang
        self.beat = min(max(self.timeout / 10, 0.5), 30.0)  # heartbeat period, seconds
        self.stale = 3 * self.beat  # no heartbeat for this long: the rank is not running
        self._mark = _Mark()
        self._changed, self._done = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._hooks: list = []

    # main thread -------------------------------------------------------------------------
    def enter(self, operation: str, step: int) -> None:
        """The main thread now runs (or waits in) ``operation`` of ``step``."""
        self._mark = _Mark(operation, step, self._mark.completed, time.monotonic())

    def completed(self, step: int) -> None:
        """``step`` steps are done (the files say so within a few milliseconds)."""
        self._mark = _Mark(None, step + 1, step, time.monotonic())
        self._changed.set()

    def progress(self) -> None:
        """The main thread moved on inside its operation: the operation's clock restarts."""
        self._mark.since = time.monotonic()

    def watch_layers(self, layers) -> None:
        """Call `progress` when each of ``layers`` starts its forward and when the gradient of
        its input is computed; undone at exit."""
        def before_forward(module, args, kwargs):
            self.progress()
            hidden = args[0] if args else kwargs.get("hidden_states")
            if getattr(hidden, "requires_grad", False):
                hidden.register_hook(lambda grad: self.progress())

        self._hooks += [layer.register_forward_pre_hook(before_forward, with_kwargs=True)
                        for layer in layers]

    def idle(self) -> None:
        """Stop watching (the loop is over); the heartbeat goes on."""
        self._mark = _Mark(None, self._mark.step, self._mark.completed, time.monotonic())
        self._changed.set()

    def __enter__(self) -> Watchdog:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write(time.monotonic())
        self._thread = threading.Thread(target=self._run, name="lctrain-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._done.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join()

    # watchdog thread ---------------------------------------------------------------------
    def _run(self) -> None:
        last_write = last_tick = time.monotonic()
        while not self._done.is_set():
            self._changed.wait(timeout=min(self.beat, max(self.timeout / 4, 0.05)))
            changed = self._changed.is_set()  # a completed step, or the end
            self._changed.clear()
            now = time.monotonic()
            if now - last_tick > 3 * self.beat:  # this whole process was paused: restart clocks
                self._mark.since += now - last_tick
            last_tick = now
            if changed or now - last_write >= self.beat:
                self._write(now)
                last_write = now
            mark = self._mark
            if mark.operation is not None and now - mark.since > self.timeout:
                self.on_hang(self.report(mark, now - mark.since))
                return

    def _write(self, now: float) -> None:
        mark = self._mark
        record = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                  "completed": mark.completed, "step": mark.step, "operation": mark.operation,
                  "for_s": round(now - mark.since, 3), "time": time.time()}
        # a heartbeat is best effort: a full disk must not end the run from here
        write_json(self.folder / f"rank{self.rank}.json", record)

    def report(self, mark: _Mark, waited: float) -> str:
        """The sentence naming the operation this rank waits in and the ranks that are late."""
        beats = read_heartbeats(self.folder)
        now = time.time()
        late = []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            beat = beats.get(rank)
            if beat is None:
                late.append(f"rank {rank} (no heartbeat at all: it never reached training)")
            elif now - beat["time"] > self.stale:
                late.append(f"rank {rank} (pid {beat['pid']} on {beat['host']}: no heartbeat for "
                            f"{now - beat['time']:.0f} s, so it is stopped, frozen or dead; last "
                            f"seen {_where(beat)})")
            elif (beat["step"], beat["operation"]) != (mark.step, mark.operation):
                late.append(f"rank {rank} (alive, but still {_where(beat)})")
        head = (f"rank {self.rank} waited {waited:.0f} s in {mark.operation} of step {mark.step} "
                f"(train.collective_timeout is {self.timeout:g} s)")
        if late:
            return f"{head}; these ranks did not arrive: {'; '.join(late)}."
        return (f"{head}; every rank is alive and waiting in the same operation, so a collective "
                "never completes (the ranks disagree on what to run).")


def _where(beat: dict) -> str:
    if beat.get("operation") is None:
        return f"between steps, after step {beat['completed']}"
    return f"in {beat['operation']} of step {beat['step']}"
