"""An evaluation's result: its JSON document (what ``--json FILE`` writes), a table, and a plot
(perplexity by position, or passkey accuracy as a length × depth heatmap). The document is
``{"lctrain_eval": 1, "task": "ppl" | "passkey", "title", "meta", "rows"}``: ppl rows are position
buckets then ``"all"``; passkey rows are (length, depth) pairs, every trial under ``samples``."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lctrain.errors import UserError
from lctrain.report import plotting
from lctrain.report.human import gib, parameters, significant, tokens
from lctrain.report.table import Column, ResultDocument, Table, emit, read_document, say, show



@dataclass
class EvalResult(ResultDocument):
    """Rows of one evaluation and the facts they were measured under."""

    MARK, KEY = "lctrain_eval", "task"
    task: str


def load(path: str | Path) -> EvalResult:
    """Read a result file (UserError: missing, not JSON, or not an evaluation result)."""
    target, data = read_document(path)
    if not isinstance(data, dict) or data.get("task") not in COLUMNS or \
            not isinstance(data.get("rows"), list):
        raise UserError(f"{target} is not an lctrain eval result (task ppl or passkey with rows)")
    return EvalResult(task=data["task"], title=str(data.get("title") or data["task"]),
                      rows=data["rows"], meta=dict(data.get("meta") or {}))


COLUMNS = {
    "ppl": [Column("bucket", "positions"), Column("tokens", "scored", "number", "tokens"),
            Column("loss", "loss", "loss", "nats"), Column("ppl", "perplexity", "number"),
            Column("start", "from", "number", compact=False),
            Column("stop", "to", "number", compact=False)],
    "passkey": [Column("seq_len", "length", "tokens"), Column("depth", "depth", "percent"),
                Column("needle_position", "needle at", "number", "token"),
                Column("accuracy", "accuracy", "percent"), Column("passkey", "expected"),
                Column("answer", "answer (1st)"),
                Column("trials", "trials", "number", compact=False),
                Column("placed_depth", "placed", "percent", compact=False),
                Column("seconds", "time", "seconds", compact=False),
                Column("peak_memory_bytes", "peak", "gib", "GiB", compact=False)]}


def describe(result: EvalResult) -> list[str]:
    """Lines under the table: what ran, where, how long, how much memory."""
    m = result.meta
    lines = []
    if m.get("parameters"):
        lines.append(f"{parameters(m['parameters'])} parameters, {m.get('model_dtype')} weights, "
                     f"{'bf16' if m.get('mixed_precision') == 'bf16' else m.get('model_dtype')} "
                     f"compute; dp {m.get('dp')} × cp {m.get('cp')}, {m.get('schedule')}, "
                     f"{m.get('strategy')}")
    if result.task == "ppl" and m.get("rows") is not None:
        part = " (its validation data)" if m.get("data_part") == "eval" else ""
        lines.append(f"data: {m.get('data_source')}{part}, {m['rows']:,} of "
                     f"{m.get('rows_available', m['rows']):,} rows × {tokens(m['seq_len'])} "
                     f"tokens, buckets of {tokens(m['bucket'])} positions (position = place in "
                     f"the {_context(result)})")
    if result.task == "passkey" and result.rows:
        right = sum(r["correct"] for r in result.rows)
        total = sum(r["trials"] for r in result.rows)
        lines.append(f"overall {right} of {total} right; {m.get('generated_tokens')} tokens "
                     "generated per prompt")
    if m.get("seconds") is not None:
        rate = (f", {significant(m['tokens_per_s'])} tokens/s, "
                f"{significant(m['seconds_per_row'])} s per row and cp group"
                if m.get("tokens_per_s") else "")
        peak = (f", peak memory {gib(m['peak_memory_bytes'])} GiB per rank (largest)"
                if m.get("peak_memory_bytes") else "")
        lines.append(f"{significant(m['seconds'])} s{rate}{peak}; model built and loaded in "
                     f"{significant(m.get('load_seconds') or 0)} s")
    return lines


def _context(result: EvalResult) -> str:
    """What a ppl position counts from: the document (document_mask) or the row."""
    return "document" if result.meta.get("document_mask", True) else "row"


def table(result: EvalResult) -> Table:
    """The result's rows in its task's columns, with `describe`'s lines as notes."""
    return Table(title=result.title, columns=list(COLUMNS[result.task]), rows=result.rows,
                 notes=describe(result))


def plot(result: EvalResult, path: str | Path) -> Path:
    """Draw the result into ``path`` (UserError: nothing to plot, or matplotlib missing)."""
    return (_plot_ppl if result.task == "ppl" else _plot_passkey)(result, path)


def _plot_ppl(result: EvalResult, path: str | Path) -> Path:
    points = [((r["start"] + r["stop"]) / 2, r["ppl"]) for r in result.rows
              if r.get("bucket") != "all" and r.get("ppl") is not None]
    if not points:
        raise UserError("no position bucket has a scored token, so no plot was written")
    fig, ax = plotting.figure(result.title, f"position in the {_context(result)} (tokens)",
                              "perplexity (exp of the mean token loss)")
    xs, ys = zip(*points)
    ax.plot(xs, ys, marker="o")
    ax.set_xlim(0, result.meta.get("seq_len") or max(xs) * 2)
    ticks = [r["start"] for r in result.rows if r.get("bucket") != "all"]
    ticks = ticks[::max(1, len(ticks) // 8)]
    ax.set_xticks(ticks, [tokens(t) for t in ticks])
    if max(ys) / max(min(ys), 1e-9) > 20:
        ax.set_yscale("log")
    return plotting.finish(fig, ax, path, legend=False)


def _plot_passkey(result: EvalResult, path: str | Path) -> Path:
    lengths = sorted({r["seq_len"] for r in result.rows})
    depths = sorted({r["depth"] for r in result.rows})
    if not lengths:
        raise UserError("the passkey result has no row, so no plot was written")
    cells = {(r["seq_len"], r["depth"]): r["accuracy"] for r in result.rows}
    grid = [[cells.get((n, d), float("nan")) for n in lengths] for d in depths]
    fig, ax = plotting.figure(result.title, "prompt length (tokens)",
                              "needle depth (share of the filler before it)")
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="upper")
    ax.grid(False)
    ax.set_xticks(range(len(lengths)), [tokens(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths])
    for y, row in enumerate(grid):
        for x, value in enumerate(row):
            if value == value:  # not NaN
                ax.text(x, y, f"{100 * value:.0f}%", ha="center", va="center", fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy")
    return plotting.finish(fig, ax, path, legend=False)


def eval_results(files: list[str]) -> list:
    """The evaluation results among ``files``, loaded; [] when none is one (UserError: mixed
    with bench results, which share no table)."""
    marked = [_is_eval(path) for path in files]
    if not any(marked):
        return []
    if not all(marked):
        others = [p for p, m in zip(files, marked) if not m]
        for path in others:  # a missing or broken file says so, not that it is no eval result
            read_document(path)
        raise UserError(f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not lctrain "
                        "eval results; report evaluation and bench result files separately")
    return [load(path) for path in files]


def show_eval_results(results: list, fmt: str, wide: bool, *, rows: bool, json_file,
                      plot_file) -> None:
    """Print each evaluation's table in ``fmt``; ``--plot`` draws a single one."""
    if rows or json_file is not None:
        raise UserError("--rows and --json merge bench results; an lctrain eval result is "
                        "shown as it is (use the file itself for its JSON)")
    if plot_file is not None:
        if len(results) != 1:
            raise UserError(f"--plot draws one evaluation result; {len(results)} were given")
        plotting.check_target(plot_file)
    if fmt == "json":  # one document, as lctrain eval prints it; several: a list of them
        docs = [json.loads(result.to_json()) for result in results]
        emit(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    for result in results if fmt != "json" else ():
        show(table(result), fmt, wide)
    if plot_file is not None:
        say(f"wrote the plot to {plot(results[0], plot_file)}")


def _is_eval(path: str) -> bool:
    """Whether ``path`` holds an lctrain eval document (unreadable: left to the bench loader)."""
    try:
        data = read_document(path)[1]
    except (UserError, ValueError):  # ValueError: not UTF-8
        return False
    return isinstance(data, dict) and EvalResult.MARK in data
