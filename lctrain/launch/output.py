"""Output that outlives its reader (a closed terminal, a killed ``| tee``): inside
`kept_output(log)`, a failed write to stdout or stderr points the descriptor at ``log`` and goes
on there, so no process dies from its own output. Standard library only."""
from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Iterator
from pathlib import Path

OUTPUT_LOG = "terminal.log"
"""What the launcher and its ranks said after their terminal or pipe went away (in .launch/)."""


class KeptStream:
    """``stream`` (a text stream) whose failed writes go on into ``log`` (module docstring); a
    stream without a file descriptor (an in-memory capture) is written through unchanged."""

    def __init__(self, stream, log: str | os.PathLike) -> None:
        self.stream, self.log, self.redirected = stream, Path(log), False
        try:
            self.fd = stream.fileno()
        except (OSError, ValueError, AttributeError):
            self.fd = None  # io.UnsupportedOperation is an OSError
        self.flush()

    def write(self, text: str) -> int:
        if self.fd is None:
            return self.stream.write(text)
        if self.redirected and "\x1b[" in text:  # a terminal's display (a progress bar)
            return len(text)
        self.flush()  # what others wrote through the stream itself goes first
        data = memoryview(text.encode(self.stream.encoding or "utf-8",
                                      self.stream.errors or "strict"))
        failures = 0
        while data and failures < 3:  # the terminal, the log, /dev/null
            try:
                data = data[os.write(self.fd, data):]
            except BlockingIOError:  # a descriptor someone made non-blocking: wait, go on
                select.select([], [self.fd], [], 1.0)
            except OSError:
                failures += 1
                self._redirect()
        return len(text)

    def flush(self) -> None:
        for _ in range(3):  # the terminal, the log, /dev/null
            try:
                self.stream.flush()
                return
            except RuntimeError:  # a signal handler's print inside a flush: left for later
                return
            except (OSError, ValueError):
                if self.fd is None:
                    return
                self._redirect()

    def isatty(self) -> bool:
        try:
            return os.isatty(self.fd) if self.fd is not None else self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno() if self.fd is None else self.fd

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def check(self) -> None:
        """Flush, and point the descriptor at the log if its reader is gone (POLLERR, POLLHUP)."""
        self.flush()
        if self.fd is None or self.redirected:
            return
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no poll() here
            poll = select.poll()
            poll.register(self.fd, select.POLLOUT)
            if any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
                self._redirect()

    def _redirect(self) -> None:
        """Point the descriptor at the log; when that fails too, at /dev/null (nothing is said
        any more, and nothing fails)."""
        target = os.devnull if self.redirected else self.log
        self.redirected = True
        try:
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            fd = os.open(os.devnull, os.O_WRONLY)
        with contextlib.suppress(OSError):  # a descriptor closed under us: nothing to point
            os.dup2(fd, self.fd)
        os.close(fd)


@contextlib.contextmanager
def kept_output(log: str | os.PathLike) -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as `KeptStream`s into ``log`` for the block."""
    kept = {name: KeptStream(getattr(sys, name), log) for name in ("stdout", "stderr")}
    for name, stream in kept.items():
        setattr(sys, name, stream)
    try:
        yield
    finally:
        for name, stream in kept.items():
            stream.check()
            if getattr(sys, name) is stream:
                setattr(sys, name, stream.stream)
