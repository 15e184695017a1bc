"""Why a self-launched run failed, in one report: the rank, what happened to it, the step.

`explain` weighs the ranks' error records (``.launch/errors/rank{R}.json``), the agent's
``failures.json`` (a negative exit code is the signal that killed a rank) and the last step.
Ranks that see a peer die report secondary errors, so a user error comes first, then a rank
killed by a signal nobody asked for, a hang, an exception, a stop signal. A witness that cannot
be written (a full disk) goes to stderr as one `relayed` line instead."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from lctrain.errors import UserError
from lctrain.launch.lifetime import describe_death
from lctrain.launch.stopping import stopped_by
from lctrain.launch.watchdog import read_rank_files, write_json


RELAYED = "lctrain-relayed "
"""How a line on stderr that carries a witness starts (`relay`, `relayed`)."""
_USER_KINDS = ("user", "environment")  # the user's to fix: a mistake; the machine's state


def record_error(error_dir: str | os.PathLike | None, exc: BaseException | None = None, *,
                 kind: str | None = None, message: str | None = None) -> None:
    """Write this rank's failure as ``rank{R}.json`` (atomically) into ``error_dir`` when it
    exists, else `relay` it: ``exc`` (kind "user" for a UserError, else "bug"; "environment"
    given for a full disk or a missing permission), or ``kind`` and ``message``."""
    if error_dir is None or not Path(error_dir).is_dir():
        return
    rank = int(os.environ.get("RANK", "0"))
    if exc is not None:
        kind = kind or ("user" if isinstance(exc, UserError) else "bug")
        message = message or str(exc) or type(exc).__name__
    record = {"rank": rank, "pid": os.getpid(), "time": time.time(), "kind": kind,
              "user": kind in (*_USER_KINDS, "hang"), "message": message,
              "traceback": "".join(traceback.format_exception(exc)) if exc is not None else ""}
    if not write_json(Path(error_dir) / f"rank{rank}.json", record):
        relay("record", record)


def relay(kind: str, data: dict) -> None:
    """Say ``data`` (a "record" or the agent's "failures") on stderr as one `RELAYED` line,
    in one write where stderr is a file descriptor (other threads write there too)."""
    line = f"{RELAYED}{json.dumps({kind: data})}\n"
    sys.stderr.flush()
    try:
        view = memoryview(line.encode())
        while view:
            view = view[os.write(sys.stderr.fileno(), view):]
    except (OSError, ValueError):  # io.UnsupportedOperation: an in-memory stream
        sys.stderr.write(line)


def relayed(line: str) -> tuple[str, dict] | None:
    """(kind, data) of a `relay` line (which another process's output may surround), or None
    for any other line."""
    start = line.find(RELAYED)
    if start < 0:
        return None
    try:
        found, _ = json.JSONDecoder().raw_decode(line, start + len(RELAYED))
        ((kind, data),) = found.items()
    except (ValueError, AttributeError):
        return None
    return (kind, data) if isinstance(data, dict) else None


def read_records(error_dir: str | os.PathLike) -> list[dict]:
    """Every readable error record in ``error_dir``, earliest first."""
    return sorted(read_rank_files(error_dir), key=lambda r: r["time"])


def read_failures(path: str | os.PathLike, fallback: dict | None = None) -> dict[int, dict]:
    """The agent's ``failures.json``: {rank: {"pid", "exitcode"}}, else ``fallback`` (the
    `relayed` one; {} when there is none)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        data = fallback or {}
    return {int(rank): failure for rank, failure in data.items()}


@dataclass(frozen=True)
class Outcome:
    """What the launcher reports: ``kind`` is "user", "environment" (a full disk, a missing
    permission), "signal", "hang", "bug" (``message`` is then the traceback), "stopped"
    (``exit_code`` 128 + the signal) or "unknown"."""

    kind: str
    message: str
    exit_code: int = 1


def explain(records: list[dict], failures: dict[int, dict], *, killed: set[int],
            last_step: int | None) -> Outcome:
    """Weigh the witnesses of a failed run (module docstring): `read_records`, `read_failures`,
    the pids the launcher ``killed`` itself (no cause) and the ``last_step``, if known."""
    by_kind: dict[str, list[dict]] = {}
    for record in records:  # earliest first; "user" holds the "environment" ones too
        kind = record["kind"]
        by_kind.setdefault("user" if kind in _USER_KINDS else kind, []).append(record)
    recorded = {record["rank"] for record in records}
    deaths = sorted((rank, -f["exitcode"]) for rank, f in failures.items()
                    if f.get("exitcode", 0) < 0 and f.get("pid") not in killed
                    and rank not in recorded)
    by_stop = [(rank, sig) for rank, sig in deaths if stopped_by(128 + sig) is not None]
    by_fault = [(rank, sig) for rank, sig in deaths if (rank, sig) not in by_stop]
    if "user" in by_kind:
        return Outcome(by_kind["user"][0]["kind"], by_kind["user"][0]["message"])
    if by_fault:
        return Outcome("signal", _death(*by_fault[0], failures, last_step))
    if "hang" in by_kind:
        return Outcome("hang", by_kind["hang"][0]["message"])
    if "bug" in by_kind:
        record = by_kind["bug"][0]
        return Outcome("bug", f"rank {record['rank']} failed:\n{record['traceback']}")
    if by_stop:
        return Outcome("signal", _death(*by_stop[0], failures, last_step))
    stops = {stopped_by(f.get("exitcode", 0)) for f in failures.values()}
    if failures and None not in stops:
        return Outcome("stopped", "", exit_code=128 + max(stops))
    return Outcome("unknown", "")


def _death(rank: int, signum: int, failures: dict[int, dict], last_step: int | None) -> str:
    when = (f" after step {last_step}, the last step the job completed"
            if last_step is not None else "")
    return f"rank {rank} (pid {failures[rank].get('pid')}) {describe_death(signum)}{when}"
