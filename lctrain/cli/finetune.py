"""``lctrain finetune``: load the recipe, hand it to the training runner."""
from __future__ import annotations

import typer

from lctrain.cli.usage import user_errors
from lctrain.cli.options import (MaxStepsOpt, NprocOpt, OutputDirOpt, RecipeArg, ResumeOpt,
                                 SeqLenOpt, SetOpt)
from lctrain.config import load_recipe, load_resumed


def finetune(recipe: RecipeArg = None, seq_len: SeqLenOpt = None, overrides: SetOpt = None,
             output_dir: OutputDirOpt = None, max_steps: MaxStepsOpt = None,
             resume: ResumeOpt = False, nproc: NprocOpt = None) -> None:
    """Fine-tune a model on long sequences (default: the embedded tiny recipe, CPU-friendly).

    Launches one process per GPU (or parallel.cp CPU processes) unless already started by
    torchrun / accelerate launch, and writes config.yaml, metrics.jsonl and checkpoints/ to the
    output folder. With --resume the run continues from its newest checkpoint with the recipe
    saved in its folder; --set and a recipe may change only its length, intervals, process
    layout and memory settings.

    \b
    Examples:
      lctrain finetune
      lctrain finetune llama-7b-256k --seq-len 256k --set train.lr=1e-5
      lctrain finetune --output-dir runs/tiny --resume --max-steps 40
    """
    with user_errors():
        load = load_resumed if resume else load_recipe  # resume: the run's own config.yaml
        cfg = load(recipe, overrides or [], seq_len=seq_len, output_dir=output_dir,
                   max_steps=max_steps)
        from lctrain.train.runner import finetune as run

        code = run(cfg, resume=resume, nproc=nproc)
    if code:
        raise typer.Exit(int(code))
