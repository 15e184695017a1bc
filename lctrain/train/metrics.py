"""What a run reports: ``output_dir/metrics.jsonl`` (one JSON object per logged step) and rank
0's progress display."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from lctrain.report.human import duration


class MetricsLog:
    """Appends one JSON line per logged step (rank 0 only; a no-op elsewhere)."""

    def __init__(self, path: str | os.PathLike, *, enabled: bool, resume_step: int | None) -> None:
        self.path = Path(path)
        self.enabled = enabled
        if not enabled:
            return
        # a fresh run truncates; a resumed one drops the lines past the checkpoint it resumed
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = (self.path.read_text().splitlines()
                 if resume_step is not None and self.path.exists() else [])
        kept = [line for line in lines if _step(line, self.path) <= resume_step]
        staging = self.path.with_name(self.path.name + ".tmp")  # readers never see it empty
        staging.write_text("".join(line + "\n" for line in kept))
        os.replace(staging, self.path)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(clean) + "\n")


def _step(line: str, path: Path) -> float:
    """The step of one metrics line; inf (past any checkpoint) for a blank line or one cut
    short, as a write that failed on a full disk leaves it (said once, then dropped)."""
    try:
        record = json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        print(f"warning: dropped a line of {path} that a failed write cut short: {line[:60]!r}",
              file=sys.stderr, flush=True)
        return math.inf
    return record.get("step", 0) if isinstance(record, dict) else math.inf


class Progress:
    """Rank 0's display: a rich progress bar on a terminal, else one line per log with an ETA."""

    def __init__(self, total_steps: int, start_step: int, *, enabled: bool,
                 steps_per_epoch: float | None = None) -> None:
        self.enabled = enabled
        self.total = total_steps
        self.steps_per_epoch = steps_per_epoch  # shows the epochs completed when set
        self._start, self._start_step = time.perf_counter(), start_step
        self._bar = None
        if enabled and sys.stdout.isatty():
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeRemainingColumn)

            self._bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step,
                                            info="")
            self._bar.start()

    def update(self, step: int, record: dict | None) -> None:
        if not self.enabled:
            return
        info = _describe(record) if record else None
        if info and self.steps_per_epoch:
            info = f"epoch {step / self.steps_per_epoch:.2f}  {info}"
        if self._bar is not None:
            fields = {"info": info} if info else {}
            self._bar.update(self._task, completed=step, **fields)
        elif info:
            print(f"step {step}/{self.total}  {info}{self._eta(step)}", flush=True)

    def _eta(self, step: int) -> str:
        """``  ETA 3 min 12 s`` at the mean pace since the start (empty at the end or before)."""
        done = step - self._start_step
        if done <= 0 or step >= self.total:
            return ""
        left = (self.total - step) * (time.perf_counter() - self._start) / done
        return f"  ETA {duration(left)}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _describe(record: dict) -> str:
    text = (f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s  "
            f"{record['step_time_s']:.3f} s/step  lr {record['lr']:.2e}")
    if record.get("mfu") is not None:
        text += f"  MFU {100 * record['mfu']:.1f}%"
    if record.get("eval_loss") is not None:
        text += f"  eval loss {record['eval_loss']:.4f}"
    return text
