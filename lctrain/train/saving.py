"""Saving a run's checkpoint and checking that a saved one can continue in this run.

A checkpoint's ``trainer.json`` (`trainer_state`) holds the step, the data position over all
ranks, the global batch, the layout that wrote it and the learning-rate plan; `save` refuses
non-finite weights (so no checkpoint of a diverged model replaces a good one) and hands the rest
to the run's `Checkpointer` (atomic, in the background where the recipe asks).
"""
from __future__ import annotations

import os
from pathlib import Path

from lctrain.errors import UserError
from lctrain.launch import launcher
from lctrain.checkpoint.writer import Checkpointer
from lctrain.train.loop import Trainer
from lctrain.train.optim import LrPlan
from lctrain.parallel.build import RunSetup


def check_continuation(saved: dict, setup: RunSetup, path: Path) -> None:
    """Refuse a checkpoint whose data stream this run cannot continue exactly: the position
    is in packed rows of ``data.seq_len`` tokens, taken a global batch at a time.

    Raises:
        UserError: another sequence length, or another global batch (the message names the
            train.grad_accum that keeps it).
    """
    cfg, dp = setup.cfg, setup.pmesh.dp
    t = cfg.train
    if saved["seq_len"] != cfg.data.seq_len:
        raise UserError(f"The checkpoint {path} was trained at data.seq_len {saved['seq_len']} "
                        f"but this run has {cfg.data.seq_len}; resume with the run's seq_len.")
    rows = setup.rows_per_step
    if saved["rows_per_step"] != rows:
        per_micro = dp * t.batch_size
        keep = saved["rows_per_step"] / per_micro
        fix = (f"set train.grad_accum={int(keep)} to keep it" if keep == int(keep) else
               "choose train.batch_size and train.grad_accum so that dp × batch_size × "
               "grad_accum equals it")
        raise UserError(f"The checkpoint {path} took {saved['rows_per_step']} rows per step but "
                        f"this run takes {rows} (dp {dp} × batch_size {t.batch_size} × "
                        f"grad_accum {t.grad_accum}); {fix}.")


def saved_plan(saved: dict, path: Path) -> LrPlan:
    try:
        return LrPlan.from_json(saved["lr_plan"])
    except ValueError as error:
        raise UserError(f"{path / 'trainer.json'} holds no valid learning-rate plan "
                        f"({error}); the checkpoint is damaged.") from None


def trainer_state(setup: RunSetup, trainer: Trainer) -> dict:
    """What a checkpoint's trainer.json holds: the step, the data position over all ranks
    (rows and tokens), the global batch, the layout that wrote it, the learning-rate plan."""
    pmesh, seq_len = setup.pmesh, setup.cfg.data.seq_len
    rows = trainer.data_position * pmesh.dp * setup.cfg.train.batch_size
    return {"step": trainer.step, "rows_consumed": rows, "tokens_consumed": rows * seq_len,
            "seq_len": seq_len, "rows_per_step": setup.rows_per_step,
            "layout": {"dp": pmesh.dp, "cp": pmesh.cp, "world_size": pmesh.world_size},
            "lr_plan": trainer.scheduler.lr_lambdas[0].to_json()}


def save(setup: RunSetup, trainer: Trainer, checkpointer: Checkpointer) -> Path:
    """Checkpoint the trainer's state now (collective: every rank calls it); in the background
    when the checkpointer is asynchronous.

    Returns:
        The checkpoint folder (published once written).

    Raises:
        UserError: a weight is not finite: nothing is saved and no older checkpoint is deleted.
    """
    if not trainer.weights_finite():
        raise UserError(f"the model's weights are not finite after step {trainer.step}, so no "
                        f"checkpoint was saved and none was deleted; "
                        f"{launcher.checkpoint_hint(setup.cfg, setup.pmesh.world_size)}.")
    return checkpointer.save(trainer.step, trainer_state(setup, trainer))


def make_checkpointer(setup: RunSetup, trainer: Trainer) -> Checkpointer | None:
    """The run's checkpointer (collective), or None when checkpoints are off."""
    ckpt = setup.cfg.checkpoint
    if not ckpt.enabled:
        return None
    background = ckpt.asynchronous == "on" or (ckpt.asynchronous == "auto"
                                               and trainer.device.type == "cuda")
    return Checkpointer(Path(setup.cfg.train.output_dir) / "checkpoints",
                        module=trainer.distributed.module, optimizer=trainer.optimizer,
                        keep=ckpt.keep, asynchronous=background,
                        local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
