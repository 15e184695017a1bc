"""The ``lctrain`` command line (Typer): each command parses, makes one library call, renders.
``finetune``, ``export`` and ``report`` are here; the others have modules of their own."""
from __future__ import annotations

import enum
import json
from typing import Annotated

import typer

from lctrain.cli import bench, data
from lctrain.cli.eval import eval_command
from lctrain.cli.memory import estimate_memory
from lctrain.cli.options import (Format, FormatOpt, MaxStepsOpt, NprocOpt, OneLineUsage,
                                 OutputDirOpt, PlotOpt, RecipeArg, ResumeOpt, SeqLenOpt, SetOpt,
                                 StepOpt, WideOpt, optional, user_errors)
from lctrain.config import load_recipe, load_resumed

app = typer.Typer(
    name="lctrain", cls=OneLineUsage, no_args_is_help=True, add_completion=False,
    pretty_exceptions_enable=False, rich_markup_mode=None,
    help="Fine-tune language models on very long contexts with DistFlashAttn (balanced, "
         "overlapped sequence-parallel attention).")


def _version(value: bool) -> None:
    if value:
        from lctrain.report.versions import describe, environment

        typer.echo(describe(environment()))
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True,
        help="Print the versions of lctrain, torch, triton, transformers and CUDA, and exit.")
          ) -> None:
    pass


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


class ExportDType(str, enum.Enum):
    """Data types an export can be written in."""

    float32 = "float32"
    bfloat16 = "bfloat16"


RunDirArg = Annotated[str, typer.Argument(
    metavar="RUN_DIR", show_default=False,
    help="The run's folder (its train.output_dir, holding config.yaml and checkpoints/).")]
ExportOutputOpt = Annotated[str, typer.Option(
    "--output", metavar="DIR", show_default=False,
    help="Folder to write; it must not exist yet or be empty.")]
ExportDTypeOpt = optional(ExportDType, "--dtype", None, "Data type of the written weights "
                          "(default: the one trained in, model.dtype).")
MergeOpt = Annotated[bool, typer.Option(
    "--merge",
    help="LoRA runs: write the base model with the adapters merged in, not the adapter.")]


def export(run_dir: RunDirArg, output: ExportOutputOpt, step: StepOpt = None,
           dtype: ExportDTypeOpt = None, merge: MergeOpt = False) -> None:
    """Export a checkpoint for transformers: config.json, safetensors, tokenizer (no lctrain
    needed to load it). A LoRA run exports its adapter for peft, or with --merge the merged model.

    \b
    Examples:
      lctrain export runs/tiny --output exported/tiny
      lctrain export runs/llama-lora --step 200 --merge --dtype bfloat16 --output merged/
    """
    with user_errors():
        from lctrain.export import export_run

        result = export_run(run_dir, output=output, step=step,
                            dtype=None if dtype is None else dtype.value, merge=merge)
    what = {"full": "model", "merged": "model (LoRA merged in)", "adapter": "LoRA adapter"}
    typer.echo(f"exported the {what[result.kind]} of step {result.step} ({result.dtype}) to "
               f"{result.output}: {len(result.files)} files")
    if result.kind == "adapter":
        typer.echo(f"base model: {result.base} (load with peft's PeftModel.from_pretrained)")
    if result.tokenizer_note:
        typer.echo(result.tokenizer_note)


def report(runs: list[str] = typer.Argument(
               ..., metavar="RUN_DIR", help="Run folders (train.output_dir of lctrain finetune)."),
           plot: PlotOpt = None, fmt: FormatOpt = Format.table, wide: WideOpt = False) -> None:
    """Summarise training runs: the settings that differ, steps, final and best loss, eval loss,
    tokens/s, MFU, peak memory and time; --plot draws their loss curves.

    \b
    Example:
      lctrain report runs/full runs/remat --plot losses.png
    """
    with user_errors():
        from lctrain.report.table import say, show
        from lctrain.report.plotting import check_target
        from lctrain.report.runs import load_runs, plot_losses, summary

        if plot is not None:
            check_target(plot)
        loaded = load_runs(runs)
        table = summary(loaded)
        if fmt == Format.json:  # the rows with raw values
            typer.echo(json.dumps(table.rows, indent=2, default=str))
        else:
            show(table, fmt.value, wide)
        if plot is not None:
            say(f"wrote the plot to {plot_losses(loaded, plot)}")


app.command("finetune")(finetune)
app.command("estimate-memory")(estimate_memory)
app.add_typer(bench.app, name="bench")
app.add_typer(data.app, name="data")
app.command("export")(export)
app.command("eval")(eval_command)
app.command("report")(report)


def main() -> None:
    """Entry point of the ``lctrain`` script and of ``python -m lctrain``."""
    app(prog_name="lctrain")
