"""Stopping on a signal: SIGTERM, SIGINT or SIGHUP ends a run at a step boundary, cleanly.

A scheduler preempting a job sends SIGTERM; Ctrl-C sends SIGINT; a closed terminal SIGHUP. Any
of them, on the launcher or on any one rank, asks the run to stop:

1. the signal only sets a flag (`StopRequest`); the step in progress runs to its end;
2. at every step boundary the ranks agree on the flag with one small collective
   (`StopRequest.agree`: a MAX all-reduce of one integer on the host, over gloo — on GPU runs a
   gloo group made for it (`control_group`), so the check never waits for the GPU), so all
   ranks stop after the SAME step even when only one of them got the signal;
3. with ``checkpoint.on_signal`` a checkpoint of that step is saved (unless it was just saved);
4. rank 0 says where the last checkpoint is and the exact command that resumes the run
   (`stop_message`), and every rank exits with 128 + the signal's number (130 for SIGINT, 143
   for SIGTERM), the shells' convention for "ended by that signal".

A second signal exits at once: after the first one the handlers give the signals back to the
system's default action, which ends the process even while it waits inside a collective, where
no Python code runs. The launcher does the same for its own second signal by killing every rank.

The launcher passes its own first signal on as SIGUSR1 (`LAUNCHER_REQUEST`), after writing the
signal's number into ``output_dir/.launch/stop``: a scheduler that signals every process of a
job (SLURM does) then gives each rank one stop signal and one request, not two stop signals,
so the rank does not take the request for a second signal and die. SIGUSR1 is only sent to a
rank that catches it (``/proc/PID/status``), so a rank still starting is never killed by it.
"""
from __future__ import annotations

import shlex
import signal
import threading
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that ask a run to stop after its current step."""
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
    """The flag a stop signal sets, and the collective that makes every rank agree on it.

    Usage::

        with StopRequest() as stop:        # handlers installed (main thread only); entering
            ...                            # again, nested, changes nothing
            signum = stop.agree(group)     # at a step boundary, on every rank: 0 = go on

    Attributes:
        signum: the first stop signal this process received (0: none).
        request_file: where the launcher writes the signal it passes on (`LAUNCHER_REQUEST`).
    """

    def __init__(self) -> None:
        self.signum = 0
        self.request_file: Path | None = None
        self._asked = False
        self._depth = 0
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
        if self._depth == 0:
            self.restore()

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def ignore(self) -> None:
        """Ignore stop signals for the rest of this process's life (the run is over and the
        process exits: a late signal, such as torchrun's to the ranks still exiting, must not
        turn a clean stop into a death by that signal)."""
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
        """The stop signal of any rank of ``group`` (0: none); a collective over ``group``.

        Args:
            group: a gloo process group over all ranks (see `control_group`), or None in a
                one-rank run (no collective).
        """
        if group is None:
            return self.requested()
        import torch
        import torch.distributed as dist

        flag = torch.tensor([self.requested()], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


def watched_signals() -> list[int]:
    """The stop signals this process does not ignore: one started with a signal ignored
    (``nohup`` ignores SIGHUP, a shell script's background job SIGINT) keeps ignoring it."""
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
    """The group `StopRequest.agree` runs on: host tensors over gloo, never waiting for a GPU.

    Args:
        world_group: the group of all ranks (None in a one-rank run).
        device_type: "cuda" (a gloo group is made beside NCCL's; collective: every rank calls
            this) or "cpu" (the world group is gloo already).
        timeout: a ``timedelta`` for the new group.

    Returns:
        A process group, or None when there is one rank.
    """
    if world_group is None or world_group.size() == 1:
        return None
    if device_type != "cuda":
        return world_group
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=timeout)


def resume_command(output_dir: str | Path, *, nproc: int | None = None) -> str:
    """The command that continues the run in ``output_dir`` from its newest checkpoint.

    The run's own resolved recipe (``config.yaml``) is the recipe, so no option of the first
    command has to be repeated; ``nproc`` is added when the run used a number of processes that
    is not the default.
    """
    recipe = Path(output_dir) / "config.yaml"
    command = f"lctrain finetune {shlex.quote(str(recipe))} --resume"
    return command + (f" --nproc {nproc}" if nproc is not None else "")
