"""Stopping on a signal: SIGTERM, SIGINT or SIGHUP sets a flag (`StopRequest`) that the ranks
agree on at each step boundary, so all stop (and save) after the same step and exit with 128 +
the signal; a second signal ends the process at once. The launcher passes its first signal on
as `LAUNCHER_REQUEST`, so a scheduler that signals every rank too is not a second signal."""
from __future__ import annotations

import signal
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LAUNCHER_REQUEST = signal.SIGUSR1
"""How the launcher asks its ranks to stop (the signal it got is in the request file)."""


def stop_exit_code(signum: int) -> int:
    """The exit code of a run stopped by ``signum`` (128 + its number)."""
    return 128 + int(signum)


def stopped_by(exit_code: int) -> int | None:
    """The stop signal an exit code stands for (`stop_exit_code`'s inverse), or None."""
    signum = exit_code - 128
    return signum if signum in {int(s) for s in STOP_SIGNALS} else None


class StopRequest:
    """The flag a stop signal sets: ``signum``, the first one (0: none), or the one the launcher
    wrote to ``request_file``; handlers installed by ``with`` (main thread only, nesting
    allowed). `agree` makes every rank see it."""

    def __init__(self) -> None:
        self.signum, self._asked, self._depth = 0, False, 0
        self.request_file: Path | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            for sig in watched_signals():
                self._previous[sig] = signal.signal(sig, self._handle)
            self._previous[LAUNCHER_REQUEST] = signal.signal(LAUNCHER_REQUEST, self._request)
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:  # put back the handlers that were there before
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()

    def ignore(self) -> None:
        """Ignore stop signals from now on: the run is over, and a late signal must not turn a
        clean stop into a death by that signal."""
        if self._previous:
            for sig in (*STOP_SIGNALS, LAUNCHER_REQUEST):
                signal.signal(sig, signal.SIG_IGN)
            self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.signum = self.signum or signum
        for sig in self._previous:  # a second signal takes the default action: exit at once
            if sig != LAUNCHER_REQUEST:
                signal.signal(sig, signal.SIG_DFL)

    def _request(self, signum: int, frame) -> None:
        self._asked = True

    def requested(self) -> int:
        """This process's stop signal: its own, else the one the launcher passed on (0: none)."""
        if self.signum or not self._asked or self.request_file is None:
            return self.signum
        try:
            return int(self.request_file.read_text().strip() or 0)
        except (OSError, ValueError):
            return int(signal.SIGTERM)  # asked, but the number is unreadable

    def agree(self, group) -> int:
        """The stop signal of any rank (0: none): a collective over ``group`` (`control_group`;
        None in a one-rank run)."""
        if group is None:
            return self.requested()
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.requested()], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


def watched_signals() -> list[int]:
    """The stop signals this process does not ignore (``nohup`` ignores SIGHUP, and so on)."""
    return [sig for sig in STOP_SIGNALS if signal.getsignal(sig) != signal.SIG_IGN]


def catches_request(pid: int) -> bool:
    """Whether process ``pid`` has a handler for `LAUNCHER_REQUEST` (``SigCgt`` in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (int(LAUNCHER_REQUEST) - 1) & 1)
    return False


def control_group(world_group, device_type: str, timeout):
    """The gloo group `StopRequest.agree` runs on (None with one rank); on "cuda" a new group,
    made collectively with ``timeout``, on "cpu" ``world_group`` itself."""
    if world_group is None or world_group.size() == 1:
        return None
    if device_type != "cuda":
        return world_group
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timeout)
