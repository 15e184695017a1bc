"""Bench output people can read: tables at 80 columns and in a pipe, every format, the result
contract, the README summary, plots.

The table tests read the rendered text back (cell spans from the dashed rule, units from the
header) and compare every shown value with the raw one it came from, so a cut, a lost row or a
wrong unit fails; the rows are fresh random figures of GPU-like magnitudes, with long statuses.
"""
from __future__ import annotations

import csv
import io
import json
import random
import re

import pytest
import torch

from lctrain.bench.result import BenchResult, from_dict, load, merge
from lctrain.bench.views import COLUMNS, summary, table
from lctrain.errors import UserError
from lctrain.report.human import tokens
from lctrain.report.table import render, visible_columns

_TIME = {"µs": 1e-3, "ms": 1.0, "s": 1e3}
_RATE = {"TFLOP/s": 1.0, "GFLOP/s": 1e-3, "MFLOP/s": 1e-6}


_DRAWS = random.Random()
"""This module's random values, drawn afresh in each test from the test's seed (conftest.py)."""


@pytest.fixture(autouse=True)
def _draws_from_the_test_seed():
    _DRAWS.seed(torch.initial_seed())


def _rows(kind: str, rng: random.Random) -> list[dict]:
    lengths = [rng.choice([16, 32, 64, 128, 256]) * 1024, 1000 + rng.randrange(500)]
    names = {"kernel": ["triton", "cudnn", "flash_attn"],
             "attention": ["single-gpu cudnn", "distflash", "distflash (no overlap)", "ring"],
             "step": ["train.checkpointing=full", "train.checkpointing=remat parallel.cp=4"]}[kind]
    rows = []
    for length in lengths:
        for name in names:
            fwd, bwd = rng.uniform(2, 3000), rng.uniform(5, 9000)
            row = {"seq_len": length, "status": "ok", "fwd_ms": fwd, "bwd_ms": bwd,
                   "fwd_tflops": rng.uniform(50, 700), "bwd_tflops": rng.uniform(50, 700),
                   "total_tflops": rng.uniform(50, 700), "max_rel_err": rng.uniform(1e-4, 1e-2),
                   "total_ms_min": fwd + bwd - 1, "total_ms_max": fwd + bwd + 1, "repeats": 5,
                   "correct": True}
            if kind == "kernel":
                row.update(backend=name, relation="causal")
            elif kind == "attention":
                row.update(variant=name, gpus=2, balance=rng.choice([1.0, 1.5]),
                           vs_single=rng.uniform(0.6, 1.1), hidden_share=rng.random())
            else:
                row = {"seq_len": length, "variant": name, "status": "ok",
                       "step_time_s": rng.uniform(1, 200), "tokens_per_s": rng.uniform(1e3, 2e4),
                       "mfu": rng.uniform(0.2, 0.6), "peak_gib": rng.uniform(30, 130),
                       "model_peak_gib": rng.uniform(30, 130), "gpus": 2, "cp": 2,
                       "schedule": rng.choice(["distflash", "context_parallel"]),
                       "policy": "remat", "loss_first": rng.uniform(10, 12),
                       "sm_clock_ghz": rng.uniform(1.4, 1.98), "power_w": rng.uniform(300, 700),
                       "power_limit_w": 700.0}
            rows.append(row)
    rows[-1] = {k: rows[-1][k] for k in rows[-1] if k in ("seq_len", "backend", "variant")}
    rows[-1]["status"] = ("out of memory at 1,234 tokens: the allocator could not find "
                          f"{rng.randrange(10, 99)} GiB more on GPU 0 (a long sentence)")
    return rows


def _result(kind: str) -> BenchResult:
    machine = {"gpu": "NVIDIA H200", "gpus": 2, "torch": "2.11.0+cu130"}
    meta = {"machine": machine, "dtype": "bfloat16", "heads": 32, "head_dim": 128, "causal": True}
    return BenchResult(kind=kind, title=kind, rows=_rows(kind, _DRAWS), meta=meta)


_RULE = re.compile(r"-+( +-+)*")
_UNITS = {"", "ms", "µs", "s", "TFLOP/s", "GFLOP/s", "MFLOP/s", "%", "GiB", "per step", "loss",
          "GHz", "W"}


def _grids(text: str, n_rows: int, labels: set[str]) -> list[tuple[list[str], list[list[str]]]]:
    """Each (headers "label unit", rows of cell texts) of a plain table: cell spans come from
    the dashed rule; the header lines are the label and unit lines just above it."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not _RULE.fullmatch(line):
            continue
        spans = [m.span() for m in re.finditer(r"-+", line)]

        def cut(text, spans=spans):
            text = text.ljust(spans[-1][1])
            return [text[a:b].strip() if k < len(spans) - 1 else text[a:].strip()
                    for k, (a, b) in enumerate(spans)]

        above = [cut(lines[j]) for j in (i - 2, i - 1) if j >= 0]
        units = above[-1] if all(c in _UNITS for c in above[-1]) and len(above) == 2 else None
        names = above[-2] if units is not None else above[-1]
        assert all(c in labels for c in names), names
        headers = [f"{n} {u}".strip() for n, u in zip(names, units or [""] * len(names))]
        out.append((headers, [cut(row) for row in lines[i + 1:i + 1 + n_rows]]))
    return out


def _number(cell: str) -> float:
    cell = cell.replace(",", "").rstrip("×")
    if cell.endswith(("K", "M")):
        return float(cell[:-1]) * (1024 if cell[-1] == "K" else 1024 ** 2)
    return float(cell)


def _check_cell(column, header: str, cell: str, value, notes: list[str]) -> None:
    if value is None:
        assert cell == "-", (column.key, cell)
        return
    if column.kind == "status":
        if cell.startswith("["):
            assert f"{cell} {value}" in notes, (cell, value)
        else:
            assert cell == value
        return
    if column.kind in ("text",):
        assert cell == str(value)
        return
    if column.kind == "bool":
        assert cell == ("yes" if value else "no")
        return
    got = _number(cell)
    unit = header.split()[-1] if " " in header else ""
    if column.kind in ("ms", "seconds"):
        want = value * (1e3 if column.kind == "seconds" else 1.0) / _TIME[unit]
    elif column.kind == "tflops":
        want = value / _RATE.get(unit, 1.0)
    elif column.kind == "percent":
        want = 100 * value
    else:
        want = value
    rel = 0.05 if column.kind == "sci" else 6e-3  # two significant digits: ±0.05 of 1.0–9.9
    assert got == pytest.approx(want, rel=rel, abs=0.051 if column.kind == "percent" else 0), \
        (column.key, cell, value)


def _check_every_value(result: BenchResult, text: str, wide: bool) -> None:
    shown = table(result)
    columns = visible_columns(shown, wide)
    rows = shown.rows  # the result's rows, plus what the view derives (e.g. step labels)
    notes, open_note = [], False  # numbered notes, their wrapped lines joined again
    for line in text.splitlines():
        if line.startswith("["):
            notes.append(line)
            open_note = True
        elif open_note and line.startswith("    "):  # a wrapped note goes on, indented
            notes[-1] += " " + line.strip()
        else:
            open_note = False
    seen = {}
    grids = _grids(text, len(rows), {c.label for c in columns})
    assert grids
    for headers, body in grids:
        assert len(body) == len(rows)  # no row lost
        last = -1  # headers follow the columns' order: match them greedily, in order
        for k, header in enumerate(headers):
            last = next(j for j in range(last + 1, len(columns)) if header == columns[j].label
                        or header.startswith(columns[j].label + " ")
                        and header[len(columns[j].label) + 1:] in _UNITS)
            column = columns[last]
            for row, line in zip(rows, body):
                _check_cell(column, header, line[k], row.get(column.key), notes)
            seen[column.key] = True
    assert set(seen) == {c.key for c in columns}  # every visible column was shown


@pytest.mark.parametrize("kind", ["kernel", "attention", "step"])
@pytest.mark.parametrize("wide", [False, True])
def test_tables_keep_every_value_at_80_columns_and_in_a_pipe(kind, wide):
    result = _result(kind)
    shown = table(result)
    terminal = render(shown, "table", wide=wide, terminal=True, width=80)
    assert max(len(line) for line in terminal.splitlines()) <= 80
    _check_every_value(result, terminal, wide)
    piped = render(shown, "table", wide=wide)  # no terminal: no width limit, one grid
    labels = {c.label for c in shown.columns}
    assert len(_grids(piped, len(result.rows), labels)) == 1
    _check_every_value(result, piped, wide)
    if not wide:  # the compact default fits 80 columns in one piece
        assert len(_grids(terminal, len(result.rows), labels)) == 1


@pytest.mark.parametrize("kind", ["kernel", "attention", "step"])
def test_markdown_csv_and_json_carry_the_rows(kind):
    result = _result(kind)
    markdown = render(table(result), "markdown", wide=True)
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(result.rows)
    assert all(line.count(" | ") == lines[0].count(" | ") for line in lines)
    assert any(result.rows[-1]["status"] in note for note in markdown.splitlines())
    parsed = list(csv.DictReader(io.StringIO(render(table(result), "csv"))))
    assert len(parsed) == len(result.rows)
    for row, back in zip(result.rows, parsed):
        for key, value in row.items():  # raw and unrounded
            assert back[key] == str(value)
    again = from_dict(json.loads(result.to_json()))
    assert again.rows == result.rows and again.kind == kind and again.meta == result.meta


def test_step_rows_name_the_layer_policies_an_auto_run_placed():
    placed = f"remat={_DRAWS.randrange(1, 30)},none={_DRAWS.randrange(1, 30)}"
    base = {"seq_len": 65536, "status": "ok", "step_time_s": 3.0, "gpus": 1, "cp": 1}
    rows = [{**base, "variant": "train.checkpointing=auto", "policy": "auto",
             "layer_policies": placed},
            {**base, "variant": "train.checkpointing=remat", "policy": "remat",
             "layer_policies": None},
            {**base, "variant": f"train.layer_policies={placed}", "policy": "auto",
             "layer_policies": placed},  # rows of older runs; today's say "checkpointing"
            {**base, "variant": "train.checkpointing=auto", "policy": "auto",
             "checkpointing": placed}]
    result = BenchResult(kind="step", title="step", rows=rows, meta={"machine": {}})
    cells = [line.split(" | ")[1] for line in render(table(result), "markdown").splitlines()
             if line.startswith("| ") and "---" not in line][1:]
    assert cells == [f"checkpointing=auto ({placed})", "checkpointing=remat",
                     f"layer_policies={placed}", f"checkpointing=auto ({placed})"]


def test_compact_columns_are_the_documented_ones():
    assert [c.key for c in COLUMNS["attention"] if c.compact][:8] == [
        "variant", "seq_len", "fwd_tflops", "bwd_tflops", "total_tflops", "vs_single", "balance",
        "status"]


def test_result_files_load_merge_and_refuse_what_is_not_a_result(tmp_path):
    a, b = _result("attention"), _result("attention")
    a.meta["command"], b.meta["command"] = "lctrain bench attention --seq-len 64k", "other"
    b.meta["machine"] = {**b.meta["machine"], "torch": "2.13"}
    merged = merge([load(a.save(tmp_path / "a.json")), load(b.save(tmp_path / "b.json"))])
    assert len(merged.rows) == len(a.rows) + len(b.rows)
    assert merged.meta["machine"] == {"gpu": "NVIDIA H200", "gpus": 2}  # shared facts stay
    assert {r["command"] for r in merged.rows} == {"lctrain bench attention --seq-len 64k", "other"}
    with pytest.raises(UserError, match="different kinds"):
        merge([a, _result("kernel")])
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(UserError, match="is not JSON"):
        load(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('{"rows": [], "kind": "nope"}')
    with pytest.raises(UserError, match="unknown kind"):
        load(tmp_path / "y.json")
    with pytest.raises(UserError, match="cannot read"):
        load(tmp_path / "missing.json")


def test_summary_pivots_lengths_down_and_variants_across():
    result = _result("attention")
    table = summary(result)
    variants = list(dict.fromkeys(r["variant"] for r in result.rows))
    assert [c.key for c in table.columns] == ["seq_len", *variants]
    assert len(table.rows) == len({r["seq_len"] for r in result.rows})
    ok = next(r for r in result.rows if r["variant"] == "distflash")
    cell = next(t for t in table.rows if t["seq_len"] == ok["seq_len"])["distflash"]
    rate, ratio = re.fullmatch(r"([\d,.]+) \(([\d.]+)×\)", cell).groups()
    assert float(rate.replace(",", "")) == pytest.approx(ok["total_tflops"], rel=6e-3)
    assert float(ratio) == pytest.approx(ok["vs_single"], rel=6e-3)
    text = render(table, "markdown")
    assert "TFLOP/s per GPU" in text and "2 × NVIDIA H200" in text


def test_plot_has_human_axes_and_no_file_without_numbers(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lctrain.bench.publish import plot

    result = _result("attention")
    captured = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        captured["fig"] = fig
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)  # keep the figure to look at its axes
    path = plot(result, tmp_path / "a.png")
    assert path.stat().st_size > 10_000
    ax = captured["fig"].axes[0]
    assert ax.get_xlabel() == "total sequence length" and ax.get_ylabel().startswith("TFLOP/s per GPU")
    title = ax.get_title(loc="left")
    assert "2 × NVIDIA H200" in title and "bfloat16" in title and "32 heads × 128" in title
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert all(re.fullmatch(r"[\d,]+K?", t) for t in ticks) and any(t.endswith("K") for t in ticks)
    styles = {line.get_label(): line.get_linestyle() for line in ax.get_lines()}
    assert styles["one GPU (cudnn), reference"] == "--" and styles["distflash"] == "-"
    legend = ax.get_legend()
    assert legend is not None and legend.get_bbox_to_anchor().x0 > ax.bbox.x1 - 1  # beside the data
    failed = BenchResult(kind="kernel", title="k", rows=[{"backend": "x", "seq_len": 8,
                                                          "status": "needs a GPU"}])
    with pytest.raises(UserError, match="no plot was written"):
        plot(failed, tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()
    for kind in ("report", "data"):  # the data bench's result is its table
        with pytest.raises(UserError, match="has no plot"):
            plot(BenchResult(kind=kind, title="t", rows=[{"seq_len": 8, "status": "ok"}]),
                 tmp_path / "t.png")


def test_bench_report_turns_result_files_into_the_readme_table(tmp_path):
    from typer.testing import CliRunner

    from lctrain.cli import app

    parts = [_result("attention"), _result("attention")]
    for part, length in zip(parts, (65536, 131072)):  # one table measured in two runs
        for row in part.rows:
            row["seq_len"] = length
    files = [str(p.save(tmp_path / f"{i}.json")) for i, p in enumerate(parts)]
    merged = tmp_path / "merged.json"
    result = CliRunner().invoke(app, ["bench", "report", *files, "--format", "markdown",
                                      "--json", str(merged)])
    assert result.exit_code == 0, result.output
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| length | single-gpu cudnn | distflash |")
    assert [line.split(" | ")[0] for line in table[1:]] == ["| 64K", "| 128K"]
    assert len(load(merged).rows) == sum(len(p.rows) for p in parts)
    rows = CliRunner().invoke(app, ["bench", "report", files[0], "--rows"])
    assert rows.exit_code == 0 and "vs 1 GPU" in rows.stdout
    mixed = CliRunner().invoke(app, ["bench", "report", files[0],
                                     str(_result("kernel").save(tmp_path / "k.json"))])
    assert mixed.exit_code == 1 and "different kinds" in mixed.stderr


@pytest.mark.parametrize("kind", ["kernel", "attention"])
@pytest.mark.parametrize("wide", [False, True])
def test_document_rows_keep_every_value_and_their_mix_at_80_columns(kind, wide):
    """The mix of each spec and length is too long for a column: the notes carry it; several
    specs get a numbered mix column; "of dense" is a column of the kernel table and a
    percentage in its summary cells."""
    result = _result(kind)
    rng = _DRAWS
    specs = ["lognormal:mean=12k", "20k,12k,9k,7k,5k,4k,3x2k,1k,rest"][:2 if kind == "kernel" else 1]
    mixes = {}
    for i, row in enumerate(result.rows):
        spec = specs[i % len(specs)]
        mixes.setdefault((spec, row["seq_len"]), f"{rng.randrange(2, 99)} documents of 1k..20k "
                                                 f"tokens, median {rng.randrange(2, 19)}k")
        row.update(documents=spec, mix=mixes[(spec, row["seq_len"])])
        if kind == "kernel" and row.get("total_tflops"):
            row.update(of_dense=rng.uniform(0.3, 1.1), of_dense_fwd=rng.uniform(0.3, 1.1),
                       of_dense_bwd=rng.uniform(0.3, 1.1))
    result.rows[0]["documents"] = None  # a dense reference row
    for key in ("mix", "of_dense", "of_dense_fwd", "of_dense_bwd"):
        result.rows[0].pop(key, None)
    result.meta.update(documents=specs if kind == "kernel" else specs[0], dense_reference="cudnn")
    shown = table(result)
    text = render(shown, "table", wide=wide, terminal=True, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    _check_every_value(result, text, wide)
    joined = " ".join(line.strip() for line in text.splitlines())  # notes wrap at 80
    for (spec, length), mix in mixes.items():
        if any(r.get("mix") == mix for r in result.rows):
            assert f"documents {spec} at {tokens(length)}: {mix}" in joined
    assert "useful FLOPs" in joined
    assert ("2 document mixes" if kind == "kernel" else "documents lognormal:mean=12k") in joined
    if not wide:
        labels = {c.label for c in shown.columns}
        assert len(_grids(text, len(result.rows), labels)) == 1  # compact: one piece
    if kind == "kernel":
        assert "of dense (%) = useful rate over cudnn's rate" in joined
        ok = next(r for r in result.rows if r.get("of_dense") and r["documents"])
        line = next(t for t in summary(result).rows
                    if (t["seq_len"], t["documents"]) == (ok["seq_len"], ok["documents"]))
        rate, share = re.fullmatch(r"([\d,.]+) \((\d+)%\)", line[ok["backend"]]).groups()
        assert float(share) == pytest.approx(100 * ok["of_dense"], abs=0.51)


def test_plot_draws_one_line_per_backend_and_documents_mix(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lctrain.bench.publish import plot

    rows = [{"backend": b, "seq_len": n, "documents": d, "status": "ok",
             "total_tflops": _DRAWS.uniform(100, 600)}
            for b in ("cudnn_ragged", "triton") for d in ("8x8k", "32x2k") for n in (32768, 65536)]
    rows.append({"backend": "cudnn (dense)", "seq_len": 65536, "documents": None, "status": "ok",
                 "total_tflops": 550.0})
    captured = {}
    real_savefig = plt.Figure.savefig
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: (
        captured.setdefault("fig", fig), real_savefig(fig, *a, **k))[1])
    plot(BenchResult(kind="kernel", title="k", rows=rows), tmp_path / "k.png")
    lines = {line.get_label(): list(line.get_xdata()) for line in captured["fig"].axes[0].get_lines()}
    assert lines == {"cudnn_ragged 8x8k": [32768, 65536], "cudnn_ragged 32x2k": [32768, 65536],
                     "triton 8x8k": [32768, 65536], "triton 32x2k": [32768, 65536],
                     "cudnn (dense)": [65536]}


def test_bench_report_shows_eval_results_as_lctrain_eval_does(tmp_path):
    """An ``lctrain eval --json`` file: its table in every format (the published evaluation
    tables come from their files like the bench's); mixed with a bench file, or with options
    that only merge bench results, it is one sentence and exit 1."""
    from typer.testing import CliRunner

    from lctrain.cli import app
    from lctrain.eval.result import EvalResult

    rng = _DRAWS
    losses = [rng.uniform(1.0, 12.0) for _ in range(3)]
    rows = [{"bucket": f"{4 * i}K–{4 * i + 4}K", "start": 4096 * i, "stop": 4096 * (i + 1),
             "tokens": 4096, "loss": loss, "ppl": 2.718281828 ** loss}
            for i, loss in enumerate(losses)]
    path = EvalResult(task="ppl", title="Loss by position — a test", rows=rows,
                      meta={"seconds": 2.5, "peak_memory_bytes": 3 * 2**30}).save(
        tmp_path / "ppl.json")
    result = CliRunner().invoke(app, ["bench", "report", str(path), "--format", "markdown"])
    assert result.exit_code == 0, result.output
    body = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert body[0] == "| positions | scored (tokens) | loss (nats) | perplexity |"
    assert [line.split(" | ")[2] for line in body[1:]] == [f"{x:.4f}" for x in losses]
    assert "peak memory 3.00 GiB per rank" in result.stdout
    as_json = CliRunner().invoke(app, ["bench", "report", str(path), "--format", "json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == json.loads(path.read_text())
    bench = str(_result("kernel").save(tmp_path / "k.json"))
    for args, words in (([str(path), bench], "is not lctrain eval results; report evaluation "
                                             "and bench result files separately"),
                        ([str(path), "--rows"], "--rows and --json merge bench results")):
        refused = CliRunner().invoke(app, ["bench", "report", *args])
        assert refused.exit_code == 1 and words in refused.stderr, refused.output
