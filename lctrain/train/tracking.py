"""Where rank 0 writes a run's metrics (``train.report_to``): metrics.jsonl and TensorBoard event
files in ``train.output_dir``, and W&B or MLflow runs named after the folder, whose ids stay in
`TRACKER_IDS` so that a resumed run logs on into them."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

from lctrain.config import RecipeConfig
from lctrain.config.resume import flatten
from lctrain.errors import ConfigError, UserError, first_line
from lctrain.train.metrics import MetricsLog

SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "eval_loss": "eval/loss", "tokens_per_s": "perf/tokens_per_s",
           "step_time_s": "perf/step_time_s", "mfu": "perf/mfu",
           "attention_balance": "perf/attention_balance", "alloc_retries": "perf/alloc_retries"}
"""metrics.jsonl key -> TensorBoard (and W&B, MLflow) tag."""

PACKAGED = ("tensorboard", "wandb", "mlflow")
"""The ``train.report_to`` names that need the package of that name."""

TRACKER_IDS = "trackers.json"
"""The W&B and MLflow run ids of a run folder, which a resumed run continues."""

_EVENTS = "events.out.tfevents.*"


def check_report_to(cfg: RecipeConfig) -> None:
    """Refuse (ConfigError) a ``train.report_to`` destination whose package is not installed."""
    for name in cfg.train.report_to:
        if name in PACKAGED and importlib.util.find_spec(name) is None:
            raise ConfigError(f"train.report_to asks for {name} but the {name} package is not "
                              f"installed; pip install {name}, or drop {name} from "
                              "train.report_to", key="train.report_to")


def scalars(record: dict) -> dict[str, float]:
    """The tags and finite values of one metrics record (`SCALARS`, and memory peaks in GiB)."""
    out = {tag: float(record[key]) for key, tag in SCALARS.items()
           if isinstance(record.get(key), (int, float)) and math.isfinite(record[key])}
    for key, tag in (("peak_memory_bytes", "perf/peak_memory_gib"),
                     ("peak_reserved_bytes", "perf/peak_reserved_gib")):
        if isinstance(record.get(key), (int, float)):
            out[tag] = record[key] / (1 << 30)
    return out


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
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, int(record["step"]))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class TrackerRuns:
    """The W&B and MLflow runs of ``train.report_to`` (none unless ``enabled``), through
    accelerate's trackers; ``resume_step`` as for `TensorBoardLog`: a resumed run continues the
    runs named in the folder's `TRACKER_IDS` (a fresh one starts new runs)."""

    def __init__(self, cfg: RecipeConfig, *, enabled: bool, resume_step: int | None) -> None:
        self.trackers: list = []
        names = [n for n in ("wandb", "mlflow") if enabled and n in cfg.train.report_to]
        if not names:
            return
        out = Path(cfg.train.output_dir).resolve()
        ids_file = out / TRACKER_IDS
        ids = (json.loads(ids_file.read_text())
               if resume_step is not None and ids_file.exists() else {})
        recipe = flatten(cfg.to_dict())
        for name in names:
            try:
                ids[name] = self._start(name, out, ids.get(name), recipe)
            except Exception as error:  # no login, no server, ...: say why, in one sentence
                self.close()
                raise UserError(f"train.report_to asks for {name} but its run did not start "
                                f"({first_line(error)}); fix that, or drop {name} from "
                                f"train.report_to")
        ids_file.write_text(json.dumps(ids) + "\n")

    def _start(self, name: str, out: Path, run_id: str | None, recipe: dict) -> str:
        """Start (or continue, with ``run_id``) one tracker run; its id."""
        from accelerate.tracking import MLflowTracker, WandBTracker

        if name == "wandb":
            tracker = WandBTracker(os.environ.get("WANDB_PROJECT", "lctrain"), name=out.name,
                                   id=run_id, resume="allow" if run_id else None,
                                   dir=os.environ.get("WANDB_DIR") or str(out))
        else:  # the MLFLOW_* variables (tracking URI, experiment, run id) come first
            tracker = MLflowTracker(experiment_name="lctrain", run_id=run_id, run_name=out.name)
        tracker.start()
        self.trackers.append(tracker)
        if name == "wandb" or run_id is None:  # MLflow refuses to change a logged param
            tracker.store_init_configuration(recipe)
        return tracker.tracker.id if name == "wandb" else tracker.tracker.info.run_id

    def write(self, record: dict) -> None:
        """Log the scalars of one metrics record at its step. A tracker that fails mid-run (its
        server gone, say) is dropped with one warning: training goes on, metrics.jsonl keeps all."""
        values = scalars(record)
        for tracker in list(self.trackers):
            try:
                tracker.log(values, step=int(record["step"]))
            except Exception as error:  # noqa: BLE001 - whatever the tracker's client raises
                self.trackers.remove(tracker)
                print(f"warning: {tracker.name} stopped taking metrics at step {record['step']} "
                      f"({first_line(error)}); training goes on without it", file=sys.stderr,
                      flush=True)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


class Tracking:
    """Every destination of ``train.report_to`` behind one ``write`` (a no-op unless
    ``enabled``, on rank 0); ``resume_step`` as for `TensorBoardLog`."""

    def __init__(self, cfg: RecipeConfig, *, enabled: bool, resume_step: int | None) -> None:
        out, wanted = Path(cfg.train.output_dir), cfg.train.report_to
        self.trackers = TrackerRuns(cfg, enabled=enabled, resume_step=resume_step)  # may fail
        self.jsonl = MetricsLog(out / "metrics.jsonl", enabled=enabled and "jsonl" in wanted,
                                resume_step=resume_step)
        self.tensorboard = TensorBoardLog(out, enabled=enabled and "tensorboard" in wanted,
                                          resume_step=resume_step)

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        self.tensorboard.write(record)
        self.trackers.write(record)

    def close(self) -> None:
        self.tensorboard.close()
        self.trackers.close()
