"""A run's end: rank 0 writes ``output_dir/final/`` (`export_final`); a resumed run that has
trained all its steps trains nothing (`finished`), writing ``final/`` only where it is stale."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lctrain.config import RecipeConfig
from lctrain.config.resume import check_run_folder
from lctrain.export import export_final as write_final
from lctrain.checkpoint.reader import export_is_current, finished_checkpoint
from lctrain.launch.lifetime import RunLock


def finished_before_launch(cfg: RecipeConfig, *, resume: bool) -> bool:
    """On ``resume``, whether the run has trained all its steps, when ``train.max_steps`` alone
    sets its length (else the runner asks `finished` once the data is prepared)."""
    t = cfg.train
    if not (resume and t.epochs is None and t.max_steps is not None):
        return False
    check_run_folder(cfg, resume=True)
    main = os.environ.get("RANK", "0") == "0"
    with RunLock(t.output_dir) if main else contextlib.nullcontext():
        return finished(cfg, t.max_steps, main=main)


def finished(cfg: RecipeConfig, steps: int, *, main: bool) -> bool:
    """Whether the run in ``train.output_dir`` has already trained its ``steps`` steps; if so,
    rank 0 (``main``) says so in one sentence and writes ``final/`` if it must."""
    out = Path(cfg.train.output_dir)
    found = finished_checkpoint(out / "checkpoints", steps)
    if found is None:
        return False
    if not main:
        return True
    step, checkpoint = found
    final, done = out / "final", f"the run in {out} has already trained step {step} of {steps}"
    further = ("raise train.max_steps (--max-steps)" if cfg.train.epochs is None
               else "raise train.epochs or train.max_steps")
    if export_is_current(final, checkpoint):
        print(f"{done}, so nothing was trained; its final model is {final} ({further} to train "
              "further).", flush=True)
        return True
    why = "is missing" if not final.exists() else "is older than its last checkpoint"
    if cfg.checkpoint.export_final:
        print(f"{done}, so nothing was trained; its final model {final} {why}, so it is "
              "written now.", flush=True)
        export_final(cfg)
    else:
        print(f"{done}, so nothing was trained; its final model {final} {why} "
              f"(checkpoint.export_final is false): lctrain export {out} --output DIR writes "
              f"one from {checkpoint}.", flush=True)
    return True


def export_final(cfg: RecipeConfig) -> None:
    """Write ``final/`` on rank 0 alone (CPU; the other ranks are done) and say where it is."""
    result = write_final(cfg)
    how = "PeftModel.from_pretrained" if result.kind == "adapter" else "from_pretrained"
    print(f"exported the {result.kind} weights of step {result.step} to {result.output} "
          f"(load with {how})" + (f"; {result.tokenizer_note}" if result.tokenizer_note else ""),
          flush=True)
