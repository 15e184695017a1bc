"""Where lctrain's output goes: results on stdout (a table fitted to a terminal), progress and
notes on stderr, so a result can be piped."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from lctrain.report.table import Table, render


def say(line: str) -> None:
    """Print one progress line on stderr, at once."""
    print(line, file=sys.stderr, flush=True)


def emit(text: str) -> None:
    """Write ``text`` to stdout (a table, CSV or JSON)."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def save_document(path: str | Path, text: str) -> Path:
    """Write a JSON document to ``path``, creating its folder; returns the path."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text + "\n", encoding="utf-8")
    return target


def show(table: Table, fmt: str, wide: bool) -> None:
    """Print ``table`` on stdout in ``fmt`` (table, markdown, csv), fitted to a terminal."""
    terminal = sys.stdout.isatty()
    width = shutil.get_terminal_size((80, 24)).columns if terminal else None
    emit(render(table, fmt, wide=wide, terminal=terminal, width=width))
