"""Tables that fit: rows of raw values and :class:`Column` descriptions, rendered as aligned text
(in parts that fit a narrow terminal, no value cut), Markdown or CSV (raw values).

A column's *kind* says how its values are shown; units go into a second header line and long status
texts into numbered notes, so cells stay short. Columns no row fills are left out. Results go to
stdout (`show`, `emit`), progress and notes to stderr (`say`), so a result can be piped."""
from __future__ import annotations

import csv
import io
import json
import math
import shutil
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lctrain.errors import UserError, unwritable
from lctrain.report import human

_INLINE_STATUS = 16  # longer status texts become numbered notes under the table


@dataclass(frozen=True)
class Column:
    """One column: the row ``key``, the header ``label``, the ``kind`` (text, tokens, ms,
    seconds, tflops, ratio, percent, number, sci, gib, bytes, params, loss, bool, figure: text
    right-aligned, status: "ok" or a numbered note), a fixed ``unit`` line, and whether it is
    shown without ``wide``."""

    key: str
    label: str
    kind: str = "text"
    unit: str = ""
    compact: bool = True


@dataclass
class Table:
    """Rows of raw values and the columns to show them in; a ``{rate}`` in the title becomes
    the one FLOP-rate unit of all ``tflops`` columns. ``notes`` are printed under the table."""

    title: str
    columns: list[Column]
    rows: list[dict]
    notes: list[str] = field(default_factory=list)
    keys: int = 2  # leading columns that every part of a split table repeats


@dataclass
class _Cells:
    title: str
    headers: list[tuple[str, str]]  # (label, unit)
    right: list[bool]
    body: list[list[str]]
    notes: list[str]


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def visible_columns(table: Table, wide: bool = False) -> list[Column]:
    """The columns to show: compact ones (all with ``wide``) that at least one row fills."""
    return [c for c in table.columns if (c.compact or wide)
            and any(_present(row.get(c.key)) for row in table.rows)]


def _numbers(values: list) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _formatter(column: Column, values: list) -> tuple[str, Callable[[Any], str]]:
    """(unit for the header, cell formatter) of one column."""
    numbers = _numbers(values)
    kind = column.kind
    if kind in ("ms", "seconds"):
        scale = 1e3 if kind == "seconds" else 1.0
        unit, factor = human.time_unit([v * scale for v in numbers])
        return unit, lambda v: human.significant(v * scale * factor)
    if kind == "tflops":
        unit, factor = human.rate_unit(numbers)
        return unit, lambda v: human.significant(v * factor)
    simple: dict[str, Callable[[Any], str]] = {
        "tokens": human.tokens, "ratio": human.ratio, "number": human.significant,
        "sci": lambda v: f"{v:.1e}", "params": human.parameters, "gib": human.gib,
        "percent": lambda v: f"{100 * v:.1f}", "bool": lambda v: "yes" if v else "no",
        "loss": lambda v: f"{v:.4f}"}
    if kind == "bytes":
        from lctrain.config import format_bytes

        return column.unit, format_bytes
    unit = "%" if kind == "percent" and not column.unit else column.unit
    return unit, simple.get(kind, str)


def _cells(table: Table, wide: bool) -> _Cells:
    columns = visible_columns(table, wide)
    notes: dict[str, int] = {}  # long status text -> its number
    headers, formatters = [], []
    rates = [row.get(c.key) for c in columns if c.kind == "tflops" for row in table.rows]
    shared = "{rate}" in table.title
    title = table.title.replace("{rate}", human.rate_unit(_numbers(rates))[0])
    for column in columns:
        one_unit = shared and column.kind == "tflops"
        values = rates if one_unit else [row.get(column.key) for row in table.rows]
        unit, fmt = _formatter(column, values)
        headers.append((column.label, "" if one_unit else unit))
        formatters.append(fmt)
    body = []
    for row in table.rows:
        line = []
        for column, fmt in zip(columns, formatters):
            value = row.get(column.key)
            if not _present(value):
                line.append("-")
            elif column.kind == "status" and len(str(value)) > _INLINE_STATUS:
                line.append(f"[{notes.setdefault(str(value), len(notes) + 1)}]")
            else:
                line.append(fmt(value))
        body.append(line)
    right = [column.kind not in ("text", "status") for column in columns]
    return _Cells(title, headers, right, body,
                  [*(f"[{i}] {note}" for note, i in notes.items()), *table.notes])


def render(table: Table, fmt: str = "table", *, wide: bool = False, terminal: bool = False,
           width: int | None = None) -> str:
    """The table as text in ``fmt`` ("table", "markdown" or "csv"), ending with a newline.

    ``wide`` shows every column; ``terminal`` fits a "table" to ``width`` (default 80) by
    printing it in parts that each repeat the table's ``keys`` leading columns."""
    if fmt == "csv":
        return _csv(table)
    cells = _cells(table, wide)
    if fmt == "markdown":
        return _markdown(cells)
    if fmt != "table":
        raise ValueError(f"unknown table format {fmt!r}; choose from table, markdown, csv.")
    limit = (width or 80) if terminal else None
    out = [_wrap(cells.title, limit)] if cells.title else []
    out += [_grid(cells, part) for part in _parts(cells, limit, table.keys)]
    out += [_wrap(note, limit) for note in cells.notes]
    return "\n".join(out) + "\n"


def _wrap(text: str, width: int | None) -> str:
    if width is None or len(text) <= width:
        return text
    return "\n".join(textwrap.wrap(text, width, subsequent_indent="    ", break_long_words=False,
                                   break_on_hyphens=False))


def _widths(cells: _Cells) -> list[int]:
    lines = [*zip(*cells.headers), *cells.body]  # labels, units, rows
    return [max(len(line[i]) for line in lines) for i in range(len(cells.headers))]


def _parts(cells: _Cells, width: int | None, key_count: int) -> list[list[int]]:
    """Column indices of each part: all in one, or groups that fit ``width`` (2-space gaps)."""
    widths = _widths(cells)
    every = list(range(len(widths)))
    if width is None or sum(widths) + 2 * (len(widths) - 1) <= width:
        return [every]
    keys = every[:key_count]
    parts, current = [], list(keys)
    used = sum(widths[i] + 2 for i in keys)
    for i in every[key_count:]:
        if len(current) > len(keys) and used + widths[i] > width:
            parts.append(current)
            current, used = list(keys), sum(widths[k] + 2 for k in keys)
        current.append(i)
        used += widths[i] + 2
    parts.append(current)
    return parts


def _grid(cells: _Cells, columns: list[int]) -> str:
    """Aligned text of the given columns: one or two header lines, a rule, the rows."""
    widths = _widths(cells)

    def fmt_line(line):
        return "  ".join(line[i].rjust(widths[i]) if cells.right[i] else line[i].ljust(widths[i])
                         for i in columns).rstrip()

    labels, units = [label for label, _ in cells.headers], [unit for _, unit in cells.headers]
    heads = [labels, units] if any(units[i] for i in columns) else [labels]
    return "\n".join([*map(fmt_line, heads), "  ".join("-" * widths[i] for i in columns),
                      *map(fmt_line, cells.body)])


def _markdown(cells: _Cells) -> str:
    def escape(text: str) -> str:
        return text.replace("|", "\\|")

    heads = [escape(f"{label} ({unit})" if unit else label) for label, unit in cells.headers]
    out = [f"**{escape(cells.title)}**", ""] if cells.title else []
    out.append("| " + " | ".join(heads) + " |")
    out.append("|" + "|".join("---:" if r else "---" for r in cells.right) + "|")
    out += ["| " + " | ".join(escape(c) for c in line) + " |" for line in cells.body]
    if cells.notes:
        out += [""] + [f"{escape(note)}  " for note in cells.notes]
    return "\n".join(out) + "\n"


def _csv(table: Table) -> str:
    keys = [c.key for c in table.columns]
    for row in table.rows:
        keys += [k for k in row if k not in keys and not isinstance(row[k], (dict, list))]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(keys)
    writer.writerows(["" if row.get(k) is None else row.get(k) for k in keys] for row in table.rows)
    return buffer.getvalue()


def say(line: str) -> None:
    """Print one progress line on stderr, at once."""
    print(line, file=sys.stderr, flush=True)


def emit(text: str) -> None:
    """Write ``text`` to stdout (a table, CSV or JSON)."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


@dataclass(kw_only=True)
class ResultDocument:
    """A result's JSON document: ``{MARK: 1, KEY: its kind, "title", "meta", "rows"}``."""

    title: str
    rows: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def to_json(self, indent: int | None = 2) -> str:
        """The result as its JSON document."""
        return json.dumps({self.MARK: 1, self.KEY: getattr(self, self.KEY), "title": self.title,
                           "meta": self.meta, "rows": self.rows}, indent=indent, default=str)

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` (``--json``), creating its folder; returns the path."""
        target = writable(path, "--json")
        try:
            target.write_text(self.to_json() + "\n", encoding="utf-8")
        except OSError as error:
            raise unwritable(f"--json {path}", error) from None
        return target


def writable(path: str | Path, option: str) -> Path:
    """``path``, the file ``option`` writes once the work is done, tried before it starts so no
    work is lost: its folder is made and a scratch file made and dropped there (UserError)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UserError(f"{option} {path} is a folder; give a file name such as "
                        f"{target / ('result.json' if option == '--json' else 'plot.png')}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as error:
        raise unwritable(f"{option} {path}", error) from None
    return target


def read_document(path: str | Path, hint: str = "") -> tuple[Path, Any]:
    """(the path, its parsed JSON); UserError when unreadable or not JSON (``hint`` ends it)."""
    target = Path(path).expanduser()
    try:
        return target, json.loads(target.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read {target}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{target} is not JSON ({exc.msg} at line {exc.lineno}){hint}") from None


def show(table: Table, fmt: str, wide: bool) -> None:
    """Print ``table`` on stdout in ``fmt`` (table, markdown, csv), fitted to a terminal."""
    terminal = sys.stdout.isatty()
    width = shutil.get_terminal_size((80, 24)).columns if terminal else None
    emit(render(table, fmt, wide=wide, terminal=terminal, width=width))
