"""``lctrain export``: a run's checkpoint as a Hugging Face folder (model, or LoRA adapter)."""
from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from lctrain.cli.usage import user_errors


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
StepOpt = Annotated[Optional[int], typer.Option(
    "--step", min=0, metavar="N", show_default=False,
    help="Export the checkpoint of step N (default: the newest).")]
ExportDTypeOpt = Annotated[Optional[ExportDType], typer.Option(
    "--dtype", show_default=False,
    help="Data type of the written weights (default: the one trained in, model.dtype).")]
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
