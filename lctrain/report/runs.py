"""``lctrain report RUN_DIR...``: what training runs did, side by side, from their config.yaml and
metrics.jsonl: one row per run with the settings that differ, the losses, median tokens/s and MFU
(the first step left out), the peak memory and the time; and their loss curves."""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from lctrain.config.resume import flatten
from lctrain.errors import UserError
from lctrain.report import plotting
from lctrain.report.table import Column, Table

_IGNORED = ("train.output_dir",)  # differs between any two runs


@dataclass(frozen=True)
class Run:
    """One run folder read: its label, the recipe as flat dotted keys, the metrics records
    in step order."""

    name: str
    settings: dict
    records: list[dict]


def load_run(folder: str | Path, name: str | None = None) -> Run:
    """Read a run folder; a UserError when it, metrics.jsonl or config.yaml is unreadable."""
    path = Path(folder).expanduser()
    metrics, config = path / "metrics.jsonl", path / "config.yaml"
    if not path.is_dir():
        raise UserError(f"run folder {path} does not exist; pass folders written by lctrain "
                        "finetune (train.output_dir)")
    for needed in (metrics, config):
        if not needed.is_file():
            what = "is a folder, not a file" if needed.is_dir() else "does not exist"
            raise UserError(f"{needed} {what}; pass folders written by lctrain "
                            "finetune (train.output_dir)")
    records = []
    for number, line in enumerate(_text(metrics).splitlines(), 1):
        try:
            record = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError as exc:
            raise UserError(f"{metrics}:{number} is not valid JSON ({exc.msg} at column "
                            f"{exc.colno}); fix or remove that line") from None
        if not isinstance(record, dict):
            raise UserError(f"{metrics}:{number} is not a JSON object but a "
                            f"{type(record).__name__}; fix or remove that line")
        records += [record] if record else []
    try:
        recipe = yaml.safe_load(_text(config))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{config} is not valid YAML{at} "
                        f"({getattr(exc, 'problem', None) or type(exc).__name__}); "
                        f"it is the recipe lctrain finetune saved, so restore it") from None
    if not isinstance(recipe, dict):
        raise UserError(f"{config} holds {'nothing' if recipe is None else 'no mapping'}, not the "
                        f"recipe lctrain finetune saved; restore it")
    records.sort(key=lambda r: r.get("step", 0))
    return Run(name or path.name, flatten(recipe), records)


def _text(file: Path) -> str:
    """The UTF-8 text of a run's file (UserError naming it: unreadable or not UTF-8)."""
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{file} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at byte "
                        f"{exc.start}); restore the file lctrain finetune wrote") from None
    except OSError as exc:
        raise UserError(f"could not read {file} ({exc.strerror or type(exc).__name__}); check "
                        f"the file and its permissions") from None


def load_runs(folders: list[str]) -> list[Run]:
    """Read several run folders, labelled by folder name (by path where names repeat)."""
    paths = [Path(f).expanduser() for f in folders]
    names = [p.resolve().name for p in paths]
    return [load_run(p, name=str(p) if names.count(n) > 1 else n) for p, n in zip(paths, names)]


def differing(runs: list[Run]) -> list[str]:
    """The setting keys whose values differ between the runs (lora.* only when a run has LoRA)."""
    keys = list(dict.fromkeys(k for run in runs for k in run.settings))
    ranks = [run.settings.get("lora.rank") for run in runs]
    lora = any(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in ranks)
    unused = () if lora else ("lora.",)
    return [k for k in keys if k not in _IGNORED and not k.startswith(unused)
            and len({json.dumps(run.settings.get(k), default=str) for run in runs}) > 1]


def numbers(records: list[dict], key: str, *, step: bool = False) -> list:
    """``key``'s values in the records that hold a number for it (with ``step``: (step, value))."""
    return [(r["step"], r[key]) if step else r[key] for r in records
            if isinstance(r.get(key), (int, float))]


def median(records: list[dict], key: str) -> float | None:
    """The median of ``key`` over the records that hold a number for it (None: none does)."""
    values = numbers(records, key)
    return statistics.median(values) if values else None


def row(run: Run, keys: list[str] = ()) -> dict:
    """The summary fields of one run, with the settings ``keys``."""
    recs = run.records
    steady = recs[1:] if len(recs) > 1 else recs
    losses, evals = numbers(recs, "loss"), numbers(recs, "eval_loss")
    seconds, previous = 0.0, 0
    for r in recs:
        if isinstance(r.get("step_time_s"), (int, float)):
            seconds += r["step_time_s"] * max(1, r.get("step", previous + 1) - previous)
        previous = r.get("step", previous + 1)
    peaks = [r["peak_memory_bytes"] for r in recs if r.get("peak_memory_bytes")]
    values = {k: run.settings.get(k) for k in keys}
    return {"run": run.name, **{k: v if v is None or isinstance(v, str) else json.dumps(v)
                                for k, v in values.items()},
            "steps": recs[-1].get("step") if recs else 0,
            "loss_final": recs[-1].get("loss") if recs else None,  # None: not finite
            "loss_best": min(losses) if losses else None,
            "eval_loss": evals[-1] if evals else None,
            "tokens_per_s": median(steady, "tokens_per_s"), "mfu": median(steady, "mfu"),
            "peak_bytes": max(peaks) if peaks else None, "time_s": seconds if recs else None}


def summary(runs: list[Run]) -> Table:
    """The runs as a table: one row each, the differing settings as columns."""
    keys = differing(runs)
    columns = [Column("run", "run")]
    columns += [Column(k, k) for k in keys]  # model.path, not "path"
    columns += [Column("steps", "steps", "number"), Column("loss_final", "final", "loss", "loss"),
                Column("loss_best", "best", "loss", "loss"),
                Column("eval_loss", "eval", "loss", "loss"),
                Column("tokens_per_s", "tokens/s", "number"), Column("mfu", "MFU", "percent"),
                Column("peak_bytes", "peak", "gib", "GiB"), Column("time_s", "step time", "seconds")]
    rows = [row(run, keys) for run in runs]
    notes = [f"{k}: " + " | ".join(f"{r['run']} {r.get(k)}" for r in rows) for k in keys]
    notes.append("step time = the sum of the logged steps' times, not the wall clock")
    notes += [f"{run.name}: the last step's loss was not finite (its update skipped), so final "
              "is blank" for run in runs if run.records and run.records[-1].get("loss") is None
              and "loss" in run.records[-1]]
    if len(runs) == 1:
        s = runs[0].settings
        notes.append(f"{s.get('model.path') or s.get('model.config.model_type', 'model')}, "
                     f"seq_len {s.get('data.seq_len')}, cp {s.get('parallel.cp')}, "
                     f"{s.get('parallel.schedule')}, {s.get('train.checkpointing')}")
    return Table(title="Training runs", columns=columns, rows=rows, notes=notes)


def plot_losses(runs: list[Run], path: str | Path) -> Path:
    """Loss against step, one line per run (evaluation losses dashed); UserError: no run
    logged a loss, or matplotlib is missing."""
    curves = [(run, numbers(run.records, "loss", step=True)) for run in runs]
    if not any(points for _, points in curves):
        raise UserError("no run logged a loss, so no plot was written")
    names = ", ".join(run.name for run in runs)
    fig, ax = plotting.figure(f"Training loss — {names}", "step", "loss (cross-entropy, nats)")
    for run, points in curves:
        if points:
            line, = ax.plot(*zip(*points), label=run.name)
            evals = numbers(run.records, "eval_loss", step=True)
            if evals:
                ax.plot(*zip(*evals), linestyle="--", marker="o", color=line.get_color(),
                        label=f"{run.name} (eval)")
    return plotting.finish(fig, ax, path)
