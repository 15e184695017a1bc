"""How long the processes of a run live: they die with their launcher, one run owns its folder.

A self-launched run is a tree of processes::

    lctrain finetune                  the launcher (`lctrain.launch.launcher.spawn_workers`)
    └─ python -m lctrain.launch.agent      torch.distributed.run, in its own session
       ├─ python -m lctrain.train --config …  rank 0  (torch.distributed.run gives every
       └─ python -m lctrain.train --config …  rank 1   worker a session of its own)

Sessions keep a terminal's Ctrl-C and a ``kill`` of the launcher's process group away from the
workers: the launcher alone decides what a signal means (`lctrain.launch.stopping`). Sessions
also mean that nothing ties a worker to the launcher, so each child asks the kernel for a
parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, Linux): when the launcher dies — by
``kill -9``, ``timeout -s KILL``, an out-of-memory kill — the supervisor gets SIGKILL, and when
the supervisor dies its workers get SIGKILL, so no rank keeps training on its own. A process
whose launcher died before the request was made (the window between fork and the request)
finds out by looking up its ancestors (`die_with_launcher`).

`RunLock` makes one output folder belong to one run at a time: an ``fcntl.flock`` on
``output_dir/.launch/lock``, which the kernel releases when the holder dies however it dies, so
a crashed run never leaves the folder locked.

This module uses the standard library only: the supervisor and the workers call it before
importing torch.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import socket
import sys
from pathlib import Path

from lctrain.errors import UserError

LAUNCHER_PID_ENV = "LCTRAIN_LAUNCHER_PID"
"""Set by the launcher for the processes it starts: the pid they must not outlive."""
_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent thread exits.

    Returns:
        Whether the request was made (False off Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def die_with_launcher(levels: int) -> None:
    """Die with the launcher named in the environment, ``levels`` generations above this process.

    Sets the parent-death signal, then checks that the launcher is still an ancestor: if it died
    before the signal was asked for, this process was re-parented (to init or a sub-reaper) and
    exits at once. Without the environment variable (a launcher other than lctrain's) only the
    parent-death signal is set.

    Args:
        levels: 1 for the launcher's child (the supervisor), 2 for its grandchildren (the ranks).
    """
    die_with_parent()
    wanted = os.environ.get(LAUNCHER_PID_ENV)
    if not wanted:
        return
    pid = os.getpid()
    for _ in range(levels):
        pid = parent_pid(pid)
    if pid != int(wanted):
        print(f"lctrain: the launcher (pid {wanted}) is gone; this process stops too.",
              file=sys.stderr, flush=True)
        os._exit(1)


def parent_pid(pid: int) -> int:
    """The parent of process ``pid`` (0 when it is gone)."""
    stat = _stat(pid)
    return int(stat[1]) if stat else 0


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, pgrp, ...), or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of ``pid``, from a scan of /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat and int(stat[1]) == pid and stat[0] != "Z":
                found.append(int(entry))
    return sorted(found)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def signal_name(signum: int) -> str:
    """``"SIGKILL"`` for 9, ``"signal 77"`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_DEATHS = {signal.SIGKILL: "was killed by SIGKILL (the kernel's out-of-memory killer does that, "
                           "see dmesg; so does kill -9)",
           signal.SIGSEGV: "crashed with SIGSEGV (a segmentation fault)",
           signal.SIGBUS: "crashed with SIGBUS (a bus error, e.g. a full /dev/shm or a truncated "
                          "memory-mapped file)",
           signal.SIGABRT: "aborted with SIGABRT (a failed check in native code, or a collective "
                           "timeout)",
           signal.SIGFPE: "crashed with SIGFPE (an arithmetic fault)",
           signal.SIGILL: "crashed with SIGILL (an illegal instruction)"}


def describe_death(signum: int) -> str:
    """How a process ended by ``signum`` died, and what usually causes it (a verb phrase)."""
    return _DEATHS.get(signum, f"was ended by {signal_name(signum)}")


class RunLock:
    """Exclusive ownership of an output folder for the life of this process (or until released).

    Usage: ``with RunLock(folder): ...``. The lock file is ``folder/.launch/lock``; it holds the
    owner's pid and host for the message another run gets.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / ".launch" / "lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            UserError: another live process holds it (the message names the folder and it), or
                the folder cannot be written.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise self._unwritable(error) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{self.folder} is in use by another lctrain run (pid {owner}); wait "
                            "for it to finish or stop it, or choose another train.output_dir."
                            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            os.fsync(fd)  # a full disk says so here, not in the middle of the run
        except OSError as error:
            os.close(fd)
            raise self._unwritable(error) from None
        self._fd = fd

    def _unwritable(self, error: OSError) -> UserError:
        """The output folder cannot be written, as `lctrain.config.resume.check_writable` says
        it (one sentence with the system's reason)."""
        return UserError(f"train.output_dir {self.folder} cannot be written "
                         f"({error.strerror or type(error).__name__}); choose a folder you may "
                         "write to, on a disk with free space")

    def release(self) -> None:
        """Give the folder back (closing the file releases the lock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
