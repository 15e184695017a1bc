"""`lctrain bench report` on files written by ``lctrain eval --json``, shown as the eval
command shows them."""
from __future__ import annotations

import json
from pathlib import Path

from lctrain.errors import UserError
from lctrain.eval.result import load, plot as _draw, table
from lctrain.report.output import say, show


def eval_results(files: list[str]) -> list:
    """The evaluation results among ``files``, loaded; [] when none is one (UserError: mixed
    with bench results, which share no table)."""
    marked = [_is_eval(path) for path in files]
    if not any(marked):
        return []
    if not all(marked):
        others = [p for p, m in zip(files, marked) if not m]
        raise UserError(f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not lctrain "
                        "eval results; report evaluation and bench result files separately")
    return [load(path) for path in files]


def show_eval_results(results: list, fmt: str, wide: bool, *, rows: bool, json_file, plot
                      ) -> None:
    """Print each evaluation's table in ``fmt``; ``--plot`` draws a single one."""
    if rows or json_file is not None:
        raise UserError("--rows and --json merge bench results; an lctrain eval result is "
                        "shown as it is (use the file itself for its JSON)")
    if plot is not None and len(results) != 1:
        raise UserError(f"--plot draws one evaluation result; {len(results)} were given")
    for result in results:
        show(table(result), fmt, wide)
    if plot is not None:
        say(f"wrote the plot to {_draw(results[0], plot)}")


def _is_eval(path: str) -> bool:
    """Whether ``path`` holds an lctrain eval document (unreadable: left to the bench loader)."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "lctrain_eval" in data
