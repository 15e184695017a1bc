"""How long the processes of a run live: they die with their launcher (``PR_SET_PDEATHSIG``),
and one run owns its folder (`RunLock`, an ``flock`` the kernel releases however its holder
dies). Standard library only: used before torch is imported."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lctrain.errors import UserError, unwritable

LAUNCHER_PID_ENV = "LCTRAIN_LAUNCHER_PID"
"""The launcher's pid, which the processes it starts must not outlive."""


def die_with_parent() -> None:
    """Ask the kernel to send SIGKILL to this process when its parent thread exits (Linux)."""
    if sys.platform.startswith("linux"):  # prctl option 1: PR_SET_PDEATHSIG
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def die_with_launcher(levels: int) -> None:
    """Die with the launcher named in `LAUNCHER_PID_ENV`, ``levels`` generations up (1: the
    agent, 2: the ranks): set the parent-death signal, then exit at once if the launcher is no
    longer that ancestor (it died first). Without the variable only the signal is set."""
    die_with_parent()
    wanted = os.environ.get(LAUNCHER_PID_ENV)
    if not wanted:
        return
    pid = os.getpid()
    for _ in range(levels):
        stat = _stat(pid)
        pid = int(stat[1]) if stat else 0
    if pid != int(wanted):
        print(f"lctrain: the launcher (pid {wanted}) is gone; this process stops too.",
              file=sys.stderr, flush=True)
        os._exit(1)


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, pgrp, ...), or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of ``pid``, from a scan of /proc."""
    stats = {int(entry): _stat(int(entry)) for entry in os.listdir("/proc") if entry.isdigit()}
    return sorted(child for child, stat in stats.items()
                  if stat and int(stat[1]) == pid and stat[0] != "Z")


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
    """``with RunLock(folder):`` owns ``folder`` (``folder/.launch/lock`` holds the owner's pid
    and host, for the message another run gets)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / ".launch" / "lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (UserError: another live process holds it, or an unwritable folder)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise unwritable(f"train.output_dir {self.folder}", error) from None
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
            raise unwritable(f"train.output_dir {self.folder}", error) from None
        self._fd = fd

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:  # closing the file releases the lock
            os.close(self._fd)
            self._fd = None


PRIVATE_PREFIX = "lctrain-launch-"
"""The name of a launcher's private folders start so, in the system's temporary folder."""


@contextlib.contextmanager
def private_folder() -> Iterator[Path]:
    """A new private temporary folder for the block, removed at its end; its ``owner`` file
    holds this process's pid and host under an ``flock``, so that `collect_private_folders`
    (called here first) can remove it once this process is killed."""
    collect_private_folders()
    with tempfile.TemporaryDirectory(prefix=PRIVATE_PREFIX) as folder:
        fd = os.open(Path(folder) / "owner", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode())
            yield Path(folder)
        finally:
            os.close(fd)


def collect_private_folders(root: str | os.PathLike | None = None) -> list[Path]:
    """Remove this user's `private_folder`s in ``root`` (the system's temporary folder) whose
    owner is gone: its recorded pid is not alive on this host and its lock is free. A folder
    without an owner file, another host's or a live one's stays. Returns those removed."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(PRIVATE_PREFIX + "*"):
        try:
            if folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
            fd = os.open(folder / "owner", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            pid, _, host = os.read(fd, 300).decode(errors="replace").strip().partition(" on ")
            if not pid.isdigit() or host != socket.gethostname() or alive(int(pid)):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while the owner lives
        except OSError:
            continue
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
