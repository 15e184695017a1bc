"""How ``lctrain bench`` hands its result to people (`Publisher`): table, JSON file and ``--plot``:
fwd+bwd TFLOP/s (the single-GPU kernel dashed) or MFU (step; else tokens/s) against the sequence
length, one line per backend, variant or configuration."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from lctrain.bench.result import BenchResult
from lctrain.bench.views import WHAT, describe, short_variant, summary, table
from lctrain.errors import UserError
from lctrain.report.table import emit, say, show, writable
from lctrain.report import plotting
from lctrain.report.human import rate_unit


def check(kind: str, path: str | Path) -> Path:
    """Before running: a UserError unless a result of ``kind`` can be plotted to ``path``."""
    if kind not in ("kernel", "attention", "step"):  # rates or MFU against the length
        raise UserError(f"lctrain bench {kind} has no plot (its table is the result); drop --plot")
    return plotting.check_target(path)


def _label(result: BenchResult, row: dict) -> str:
    if result.kind != "step":  # rows of document mixes: one line per backend and mix
        name = row.get("variant" if result.kind == "attention" else "backend")
        return str(name) + (f" {row['documents']}" if row.get("documents") else "")
    if row.get("variant"):
        return short_variant(row["variant"])
    return f"{row.get('schedule', '')} {row.get('policy', '')}".strip() or "recipe"


def plot(result: BenchResult, path: str | Path) -> Path:
    """Draw the result into ``path``; returns the file written (UserError: nothing to plot)."""
    check(result.kind, path)
    if result.kind != "step":
        unit, scale = rate_unit([r.get("total_tflops") for r in result.measured()])
        per_gpu = " per GPU" if result.kind == "attention" else ""
        y, ylabel = "total_tflops", f"{unit}{per_gpu} (fwd+bwd)"
    elif any(row.get("mfu") is not None for row in result.measured()):
        y, ylabel, scale = "mfu", "MFU (%)", 100.0
    else:
        y, ylabel, scale = "tokens_per_s", "tokens/s", 1.0
    lines: dict[str, list[tuple[int, float]]] = {}
    for row in result.measured():
        if row.get(y) is not None and row.get("seq_len"):
            lines.setdefault(_label(result, row), []).append((row["seq_len"], row[y] * scale))
    if not lines:
        raise UserError("no row of the result has a number to plot (every measurement failed or "
                        "was skipped; the status column says why), so no plot was written")
    what = WHAT[result.kind].split(", {rate}")[0]
    xlabel = "total sequence length" if result.kind == "attention" else "sequence length"
    fig, ax = plotting.figure(f"{what} — {describe(result)}", xlabel, ylabel)
    for name, points in lines.items():
        xs, ys = zip(*sorted(points))
        reference = name.startswith("single-gpu")
        ax.plot(xs, ys, marker="o", linestyle="--" if reference else "-",
                color="0.35" if reference else None,
                label=f"one GPU ({name.split(' ', 1)[1]}), reference" if reference else name)
    plotting.length_axis(ax, [x for points in lines.values() for x, _ in points])
    ax.set_ylim(0, 1.08 * max(y for points in lines.values() for _, y in points))
    return plotting.finish(fig, ax, path)


def command_line() -> str | None:
    """The command as typed, when this process is the ``lctrain`` program."""
    program = Path(sys.argv[0]).name if sys.argv else ""
    if program in ("lctrain", "__main__.py"):
        return "lctrain " + shlex.join(sys.argv[1:])
    return None


class Publisher:
    """Output of one bench command of ``kind``: ``fmt`` (table, markdown, csv or json) on
    stdout, every column with ``wide``, the result JSON to ``json_file``, a plot to ``plot``.
    Made before the measurement, so a bad ``--plot`` fails before any time is spent; progress
    goes to stderr, so ``--format csv|json`` can be piped."""

    def __init__(self, kind: str, fmt: str = "table", wide: bool = False,
                 json_file: str | None = None, plot: str | None = None):
        if plot is not None:
            check(kind, plot)
        if json_file is not None:
            writable(json_file, "--json")
        self.fmt, self.wide, self.json_file, self.plot = fmt, wide, json_file, plot
        self.progress = say

    def publish(self, result: BenchResult, pivot: bool = False,
                record_command: bool = True) -> None:
        """Print, write and plot ``result``: the README form (`summary`) with ``pivot``; the
        command line goes into its meta unless the result was read back."""
        command = command_line() if record_command else None
        if command and "command" not in result.meta:
            result.meta["command"] = command
        if self.fmt == "json":
            emit(result.to_json())
        else:
            show(summary(result) if pivot else table(result), self.fmt, self.wide)
        if self.json_file is not None:
            say(f"wrote the results to {result.save(self.json_file)}")
        if not result.measured():
            raise UserError("no measurement succeeded; the status of every row says why")
        if self.plot is not None:
            say(f"wrote the plot to {plot(result, self.plot)}")
