"""Where a run's metrics go: metrics.jsonl and TensorBoard event files (``train.report_to``).

Rank 0 writes both, into ``train.output_dir``: ``metrics.jsonl`` (`lctrain.train.metrics.
MetricsLog`, one JSON object per logged step) and TensorBoard's ``events.out.tfevents.*``
beside it, so ``tensorboard --logdir runs/`` shows every run under its folder's name. The
scalars, each at its optimizer step:

    train/loss, train/lr, train/grad_norm      the step's mean token loss, learning rate, norm
    eval/loss                                  the validation loss (steps where it is computed)
    perf/tokens_per_s, perf/step_time_s        throughput of the steps since the last log
    perf/mfu                                   model FLOPs utilisation (on a known GPU)
    perf/peak_memory_gib                       the largest peak memory of any rank
    perf/attention_balance                     the busiest cp rank's attention work over the
                                               mean (packed documents, cp > 1)

A fresh run removes the event files of an earlier run in its folder (as it truncates
metrics.jsonl); a resumed run writes a new event file that tells TensorBoard to drop what an
earlier file holds past the checkpoint's step. ``tensorboard`` is checked before any process
starts (`check_report_to`): asked for but not installed, it is a one-sentence error.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from lctrain.config import RecipeConfig
from lctrain.errors import ConfigError
from lctrain.train.metrics import MetricsLog

SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "eval_loss": "eval/loss", "tokens_per_s": "perf/tokens_per_s",
           "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
           "attention_balance": "perf/attention_balance"}
"""metrics.jsonl key -> TensorBoard tag (peak memory goes in GiB, as perf/peak_memory_gib)."""

_EVENTS = "events.out.tfevents.*"


def check_report_to(cfg: RecipeConfig) -> None:
    """Raise when ``train.report_to`` asks for TensorBoard and it is not installed.

    Raises:
        ConfigError: the tensorboard package is missing (one sentence: install it or drop it).
    """
    if "tensorboard" in cfg.train.report_to and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.report_to asks for tensorboard but the tensorboard package is "
                          "not installed; pip install tensorboard, or set "
                          "train.report_to=[jsonl]", key="train.report_to")


class TensorBoardLog:
    """TensorBoard scalars of the logged steps (rank 0 only; a no-op elsewhere).

    Args:
        folder: the run's output folder.
        enabled: this is rank 0.
        resume_step: the checkpoint's step when resuming, None for a fresh run.
    """

    def __init__(self, folder: str | Path, *, enabled: bool, resume_step: int | None) -> None:
        self.writer = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            for old in folder.glob(_EVENTS):
                old.unlink()
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=(
            None if resume_step is None else resume_step + 1))

    def write(self, record: dict) -> None:
        """Add the scalars of one metrics record at its step."""
        if self.writer is None:
            return
        step = int(record["step"])
        for key, tag in SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, float(value), step)
        peak = record.get("peak_memory_bytes")
        if isinstance(peak, (int, float)):
            self.writer.add_scalar("perf/peak_memory_gib", peak / (1 << 30), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Tracking:
    """Every destination of ``train.report_to`` behind one ``write``.

    Args:
        cfg: the recipe (``train.report_to``, ``train.output_dir``).
        enabled: this is rank 0.
        resume_step: the checkpoint's step when resuming, None for a fresh run.
    """

    def __init__(self, cfg: RecipeConfig, *, enabled: bool, resume_step: int | None) -> None:
        out, wanted = Path(cfg.train.output_dir), cfg.train.report_to
        self.jsonl = MetricsLog(out / "metrics.jsonl", enabled=enabled and "jsonl" in wanted,
                                resume_step=resume_step)
        self.tensorboard = TensorBoardLog(out, enabled=enabled and "tensorboard" in wanted,
                                          resume_step=resume_step)

    def write(self, record: dict) -> None:
        """Record one logged step everywhere asked."""
        self.jsonl.write(record)
        self.tensorboard.write(record)

    def close(self) -> None:
        self.tensorboard.close()
