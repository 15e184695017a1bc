"""Where a run's metrics go (``train.report_to``): metrics.jsonl and TensorBoard event files.

Rank 0 writes both into ``train.output_dir``, so ``tensorboard --logdir runs/`` shows every run
under its folder's name (tags: `SCALARS` and perf/peak_memory_gib). A fresh run removes an
earlier run's event files; a resumed one tells TensorBoard to drop what lies past its step.
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
"""metrics.jsonl key -> TensorBoard tag."""

_EVENTS = "events.out.tfevents.*"


def check_report_to(cfg: RecipeConfig) -> None:
    """Refuse (ConfigError) ``train.report_to`` with tensorboard when it is not installed."""
    if "tensorboard" in cfg.train.report_to and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.report_to asks for tensorboard but the tensorboard package is "
                          "not installed; pip install tensorboard, or set "
                          "train.report_to=[jsonl]", key="train.report_to")


class TensorBoardLog:
    """TensorBoard scalars of the logged steps in ``folder`` (a no-op unless ``enabled``);
    ``resume_step``: the checkpoint's step when resuming, None for a fresh run."""

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
    """Every destination of ``train.report_to`` behind one ``write`` (a no-op unless
    ``enabled``, on rank 0); ``resume_step`` as for `TensorBoardLog`."""

    def __init__(self, cfg: RecipeConfig, *, enabled: bool, resume_step: int | None) -> None:
        out, wanted = Path(cfg.train.output_dir), cfg.train.report_to
        self.jsonl = MetricsLog(out / "metrics.jsonl", enabled=enabled and "jsonl" in wanted,
                                resume_step=resume_step)
        self.tensorboard = TensorBoardLog(out, enabled=enabled and "tensorboard" in wanted,
                                          resume_step=resume_step)

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        self.tensorboard.write(record)

    def close(self) -> None:
        self.tensorboard.close()
