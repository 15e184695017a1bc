"""``lctrain eval TARGET --task ppl|passkey``: evaluate a run, a model folder or a recipe's model
on all local GPUs, through the training's distributed attention."""
from __future__ import annotations

import enum
from typing import Annotated

import typer

from lctrain.cli.options import (CpOpt, Format, FormatOpt, JsonFileOpt, NprocOpt, PlotOpt,
                                 SeqLenOpt, SetOpt, StepOpt, WideOpt, optional, parsed_size,
                                 split_names, user_errors)
from lctrain.errors import UserError


class Task(str, enum.Enum):
    """What ``lctrain eval`` measures."""

    ppl = "ppl"
    passkey = "passkey"


TargetArg = Annotated[str, typer.Argument(
    metavar="TARGET", show_default=False,
    help="A run folder (its newest checkpoint, or --step), one of its checkpoints "
         "(RUN/checkpoints/step-N), a model folder (lctrain export or any transformers model), "
         "or a recipe (the model it starts from).")]
TaskOpt = Annotated[Task, typer.Option(
    "--task", help="ppl: loss and perplexity by position; passkey: retrieval of a number "
                   "hidden in long filler text.")]
DataOpt = optional(str, "--data", "SOURCE", "ppl data: a .jsonl/.json/.parquet/.txt file or "
                   "glob, builtin, or a hub dataset (default: the run's validation data, else its "
                   "training data); its format is detected from its records unless --set "
                   "data.format=... names one.")
BucketOpt = optional(str, "--bucket", "SIZE",
                     "ppl: positions per bucket, e.g. 4k (default: 1/16 of the length).")
MaxRowsOpt = optional(int, "--max-rows", "N", "ppl: evaluate only the first N rows (default: all).",
                      min=1)
LengthsOpt = optional(str, "--lengths", "SIZES", "passkey: prompt lengths in tokens, e.g. 32k,64k "
                      "(default: --seq-len or the run's).")
DepthsOpt = optional(str, "--depths", "LIST", "passkey: where the number is hidden, as shares of "
                     "the filler (default: 0,0.25,0.5,0.75,1).")
TrialsOpt = optional(int, "--trials", "N",
                     "passkey: prompts (random numbers) per length and depth (default: 1).", min=1)
SeedOpt = optional(int, "--seed", "N", "passkey: seed of the numbers (default: 0).")


def eval_command(target: TargetArg, task: TaskOpt = Task.ppl, step: StepOpt = None,
                 seq_len: SeqLenOpt = None, cp: CpOpt = None, data: DataOpt = None,
                 bucket: BucketOpt = None, max_rows: MaxRowsOpt = None,
                 lengths: LengthsOpt = None, depths: DepthsOpt = None, trials: TrialsOpt = None,
                 seed: SeedOpt = None, overrides: SetOpt = None, nproc: NprocOpt = None,
                 json_file: JsonFileOpt = None, plot: PlotOpt = None,
                 fmt: FormatOpt = Format.table, wide: WideOpt = False) -> None:
    """Evaluate a model at long context, forward only, on all local GPUs (cp from --cp or the
    recipe; gloo processes on a CPU).

    \b
    Examples:
      lctrain eval runs/tiny --task ppl --plot ppl.png
      lctrain eval runs/llama-7b-64k --step 200 --task ppl --seq-len 128k --bucket 8k
      lctrain eval exported/tiny --task passkey --lengths 4k,8k --trials 3 --plot passkey.png
    """
    with user_errors():
        from lctrain.bench.publish import command_line
        from lctrain.config import parse_size_list
        from lctrain.eval.result import plot as draw, table
        from lctrain.eval.request import resolve
        from lctrain.eval.evaluate import evaluate
        from lctrain.report.plotting import check_target
        from lctrain.report.table import emit, say, show, writable

        if plot is not None:
            check_target(plot)
        if json_file is not None:
            writable(json_file, "--json")
        cfg, request = resolve(
            target, task=task.value, step=step, seq_len=parsed_size(seq_len, "--seq-len"), cp=cp,
            data=data, overrides=overrides or [], bucket=parsed_size(bucket, "--bucket"),
            max_rows=max_rows, trials=trials, seed=seed,
            lengths=parsed_size(lengths, "--lengths", parse_size_list),
            depths=None if depths is None else _depths(depths))
        result = evaluate(cfg, request, nproc=nproc)
        if result is None:  # another rank of a torchrun job: rank 0 shows the result
            return
        result.meta.setdefault("command", command_line())
        if fmt == Format.json:
            emit(result.to_json())
        else:
            show(table(result), fmt.value, wide)
        if json_file is not None:
            say(f"wrote the result to {result.save(json_file)}")
        if plot is not None:
            say(f"wrote the plot to {draw(result, plot)}")


def _depths(text: str) -> list[float]:
    values = []
    for item in split_names(text) or []:
        try:
            values.append(float(item))
        except ValueError:
            raise UserError(f"--depths {text!r}: {item!r} is not a number; give shares such as "
                            "0,0.25,0.5,0.75,1") from None
    if not values:
        raise UserError(f"--depths {text!r} holds no depth; give shares such as 0,0.5,1")
    return values
