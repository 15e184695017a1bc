"""How ``lctrain bench`` hands its result to people: progress, table, JSON file, plot.

One :class:`Publisher` per command. It is made before the measurement starts, so a ``--plot``
that could not be written (matplotlib missing, a bad file type, a bench with no plot) fails in
one sentence before any time is spent. While the bench runs, its ``progress``
(`lctrain.report.output.say`) prints progress lines on stderr (stdout carries only the result,
so ``--format csv|json`` can be piped).
Then :meth:`Publisher.publish` prints the table in the chosen format on stdout, writes the
JSON and the plot, says on stderr where they went, and fails (non-zero exit) when no row
holds a measurement, after showing why.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from lctrain.bench.result import BenchResult
from lctrain.bench.views import summary as summary_of, table
from lctrain.errors import UserError
from lctrain.report.output import emit, say, show
from lctrain.report.table import FORMATS


def command_line() -> str | None:
    """The command as typed, when this process is the ``lctrain`` program."""
    program = Path(sys.argv[0]).name if sys.argv else ""
    if program in ("lctrain", "__main__.py"):
        return "lctrain " + shlex.join(sys.argv[1:])
    return None


class Publisher:
    """Output of one bench command (see the module docstring).

    Args:
        kind: the bench ("kernel", "attention", "step", "tiles").
        fmt: stdout format: table, markdown, csv or json.
        wide: every column in table and markdown formats.
        json_file: where to write the result JSON, or None.
        plot: where to draw the plot, or None.

    Raises:
        UserError: an unknown format, or a plot that could not be drawn.
    """

    def __init__(self, kind: str, fmt: str = "table", wide: bool = False,
                 json_file: str | None = None, plot: str | None = None):
        if fmt not in FORMATS:
            raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
        if plot is not None:
            from lctrain.bench.plot import check

            check(kind, plot)
        self.kind, self.fmt, self.wide = kind, fmt, wide
        self.json_file, self.plot = json_file, plot
        self.progress = say

    def publish(self, result: BenchResult, summary: bool = False,
                record_command: bool = True) -> None:
        """Print, write and plot ``result``; see the module docstring.

        Args:
            result: the bench's result.
            summary: print the README form (`lctrain.bench.views.summary`) instead of the
                one-row-per-measurement table.
            record_command: store the command line in the result's meta (off when the result
                was read back from files).

        Raises:
            UserError: no row holds a measurement (after printing the table and writing the
                JSON, which say why).
        """
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
