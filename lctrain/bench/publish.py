"""How ``lctrain bench`` hands its result to people: progress, table, JSON file, plot.

A :class:`Publisher` is made before the measurement starts, so a ``--plot`` that could not be
written fails in one sentence before any time is spent. Progress lines go to stderr (stdout
carries only the result, so ``--format csv|json`` can be piped); `Publisher.publish` prints
the table, writes the JSON and the plot, and fails when no row holds a measurement.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from lctrain.bench.result import BenchResult
from lctrain.bench.views import summary as summary_of, table
from lctrain.errors import UserError
from lctrain.report.output import emit, say, show


def command_line() -> str | None:
    """The command as typed, when this process is the ``lctrain`` program."""
    program = Path(sys.argv[0]).name if sys.argv else ""
    if program in ("lctrain", "__main__.py"):
        return "lctrain " + shlex.join(sys.argv[1:])
    return None


class Publisher:
    """Output of one bench command of ``kind``: ``fmt`` (table, markdown, csv or json) on
    stdout, every column with ``wide``, the result JSON to ``json_file``, a plot to ``plot``."""

    def __init__(self, kind: str, fmt: str = "table", wide: bool = False,
                 json_file: str | None = None, plot: str | None = None):
        if plot is not None:
            from lctrain.bench.plot import check

            check(kind, plot)
        self.fmt, self.wide, self.json_file, self.plot = fmt, wide, json_file, plot
        self.progress = say

    def publish(self, result: BenchResult, summary: bool = False,
                record_command: bool = True) -> None:
        """Print, write and plot ``result``: the README form (`views.summary`) with
        ``summary``; the command line goes into its meta unless the result was read back."""
        command = command_line() if record_command else None
        if command and "command" not in result.meta:
            result.meta["command"] = command
        if self.fmt == "json":
            emit(result.to_json())
        else:
            show(summary_of(result) if summary else table(result), self.fmt, self.wide)
        if self.json_file is not None:
            say(f"wrote the results to {result.save(self.json_file)}")
        if not result.measured():
            raise UserError("no measurement succeeded; the status of every row says why")
        if self.plot is not None:
            from lctrain.bench.plot import plot

            say(f"wrote the plot to {plot(result, self.plot)}")
