"""Where lctrain's output goes: results on stdout, progress and notes on stderr.

Keeping the two apart lets a user pipe a result (``--format csv | ...``, ``| tee log``) while
still seeing what runs; a table on stdout is rendered for the terminal's width when stdout is
one, and with no width limit at all anywhere else (see `lctrain.report.table.render`).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from lctrain.report.table import Table, render


def say(line: str) -> None:
    """Print one progress line on stderr, at once (module-level: it travels to spawned ranks)."""
    print(line, file=sys.stderr, flush=True)


def emit(text: str) -> None:
    """Write ``text`` to stdout (a table, CSV or JSON)."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def save_document(path: str | Path, text: str) -> Path:
    """Write a result document (JSON text) to ``path``, creating its folder; returns the path."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text + "\n", encoding="utf-8")
    return target


def terminal_width() -> int | None:
    """The terminal's width when stdout is one, else None (a pipe or a file: no limit)."""
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size((80, 24)).columns


def show(table: Table, fmt: str, wide: bool) -> None:
    """Print a `lctrain.report.table.Table` on stdout in ``fmt`` (table, markdown, csv)."""
    width = terminal_width()
    emit(render(table, fmt, wide=wide, terminal=width is not None, width=width))
