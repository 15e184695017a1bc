"""What the fault tests share: the processes a run left behind, and a full filesystem."""
from __future__ import annotations

import os
from pathlib import Path


def leftovers(out: Path) -> list[str]:
    """Processes whose command line names the run folder (the agent, the ranks, a launcher)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if str(out).encode() in cmdline:
                found.append(f"{entry}: {cmdline.decode(errors='replace')}")
    return found


def fill(disk: Path) -> None:
    """Write zeros into ``disk / "filler"`` until the filesystem is full."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
