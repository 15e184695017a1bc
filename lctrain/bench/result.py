"""BenchResult: what every ``lctrain bench ...`` run returns — rows, JSON, a table, a plot.

A result is a list of flat dict rows (one per measured configuration) plus ``meta`` (machine,
versions, fixed parameters). The CLI prints :meth:`BenchResult.table` last and writes
:meth:`BenchResult.to_json` next to it; :meth:`BenchResult.plot` draws ``y`` against ``x`` with
one line per ``series`` value when the producer named those columns.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:,.1f}"
    return str(value)


@dataclass
class BenchResult:
    """Rows of one benchmark run.

    Attributes:
        title: what was measured, e.g. "attention kernels".
        rows: one flat dict per measured configuration (JSON-serialisable values).
        meta: run-wide facts: device, versions, fixed parameters.
        columns: the table's columns in order (default: every key, in first-seen order).
        x: column for the plot's horizontal axis (None: no plot).
        y: column for the plot's vertical axis.
        series: column whose values each get one line in the plot.
    """

    title: str
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    columns: list[str] | None = None
    x: str | None = None
    y: str | None = None
    series: str | None = None

    def to_json(self, indent: int | None = 2) -> str:
        """The whole result as a JSON document ``{"title", "meta", "rows"}``."""
        return json.dumps({"title": self.title, "meta": self.meta, "rows": self.rows},
                          indent=indent, default=str)

    def _columns(self) -> list[str]:
        if self.columns is not None:
            return list(self.columns)
        seen: dict[str, None] = {}
        for row in self.rows:
            seen.update(dict.fromkeys(row))
        return list(seen)

    def table(self):
        """A ``rich.table.Table`` of the rows (floats rounded for reading; JSON keeps all)."""
        from rich.table import Table

        table = Table(title=self.title)
        columns = self._columns()
        if len(self.rows) == 1:  # one measurement reads best as a list of fields, in any width
            table.add_column("field")
            table.add_column("value", justify="right")
            for name in columns:
                table.add_row(name, _cell(self.rows[0].get(name)))
            return table
        for name in columns:
            table.add_column(name, justify="left" if name in ("backend", "status") else "right")
        for row in self.rows:
            table.add_row(*(_cell(row.get(name)) for name in columns))
        return table

    def plot(self, path) -> Path:
        """Draw ``y`` against ``x``, one line per ``series``, into an image file.

        Args:
            path: where to write the figure (format from the suffix, e.g. ``.png``).

        Returns:
            The path written.

        Raises:
            ValueError: if this result names no ``x`` / ``y`` columns to plot.
            RuntimeError: if matplotlib is not installed.
        """
        if self.x is None or self.y is None:
            raise ValueError(f"the {self.title!r} result has no x/y columns to plot.")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise RuntimeError("plotting needs matplotlib, which is not installed; install "
                               "lctrain[dev] or matplotlib.") from exc
        lines: dict[str, list[tuple]] = {}
        for row in self.rows:
            if row.get(self.x) is None or row.get(self.y) is None:
                continue
            key = str(row.get(self.series, "")) if self.series else self.y
            lines.setdefault(key, []).append((row[self.x], row[self.y]))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, points in lines.items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=key)
        if lines and all(isinstance(p[0], (int, float)) and p[0] > 0
                         for pts in lines.values() for p in pts):
            ax.set_xscale("log", base=2)
        ax.set_xlabel(self.x)
        ax.set_ylabel(self.y)
        ax.set_title(self.title)
        ax.grid(True, alpha=0.3)
        if self.series:
            ax.legend()
        path = Path(path)
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        return path
