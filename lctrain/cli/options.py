"""Options shared by the commands, as ``Annotated`` aliases (one definition, one help text).

Sizes are taken as text and parsed by the command (``lctrain.config.parse_size`` /
``parse_memory``), so a bad size is reported like every other user error: one sentence.
"""
from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from lctrain.config.schema import ATTENTION_BACKENDS, CHECKPOINTING_POLICIES
from lctrain_kernels.vocabulary import SCHEDULES

Policy = enum.Enum("Policy", [(name.replace("-", "_"), name) for name in CHECKPOINTING_POLICIES],
                   type=str)
"""Activation checkpointing policies (``train.checkpointing``), as a choice for Typer."""


class DType(str, enum.Enum):
    """Floating-point types a benchmark can run in."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


RecipeArg = Annotated[Optional[str], typer.Argument(
    metavar="RECIPE", show_default=False,
    help="Recipe YAML file or shipped recipe name (tiny, llama-7b-64k, ...); default: the "
         "embedded tiny recipe.")]
SeqLenOpt = Annotated[Optional[str], typer.Option(
    "--seq-len", metavar="SIZE", show_default=False,
    help="Sequence length (data.seq_len), e.g. 4096, 64k, 256k, 1m (k = 1024).")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="KEY=VALUE", show_default=False,
    help="Override one recipe setting, e.g. --set train.lr=1e-5 (repeatable; values are YAML).")]
OutputDirOpt = Annotated[Optional[str], typer.Option(
    "--output-dir", metavar="DIR", show_default=False,
    help="Where the run writes config.yaml, metrics.jsonl and checkpoints/ (train.output_dir).")]
MaxStepsOpt = Annotated[Optional[int], typer.Option(
    "--max-steps", min=1, metavar="N", show_default=False, help="Optimizer steps (train.max_steps).")]
ResumeOpt = Annotated[bool, typer.Option(
    "--resume", help="Continue from the latest checkpoint in the output folder.")]
NprocOpt = Annotated[Optional[int], typer.Option(
    "--nproc", min=1, metavar="N", show_default=False,
    help="Processes to launch on this machine (default: one per GPU; on a CPU: parallel.cp).")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", metavar="NAME|PATH", show_default=False,
    help="A model folder or hub name (or a preset the memory model knows) instead of a recipe.")]
GpusOpt = Annotated[int, typer.Option("--gpus", min=1, metavar="N", help="Number of GPUs.")]
GpuMemoryOpt = Annotated[str, typer.Option(
    "--gpu-memory", metavar="SIZE", help="Memory per GPU: 80GiB, 80G (1024³ bytes) or 80GB (10⁹).")]
HostMemoryOpt = Annotated[Optional[str], typer.Option(
    "--host-memory", metavar="SIZE", show_default=False,
    help="Host memory per machine (e.g. 251GiB): remat-offload's pinned activations must fit too.")]
GpusPerNodeOpt = Annotated[Optional[int], typer.Option(
    "--gpus-per-node", min=1, metavar="N", show_default=False,
    help="GPU processes per machine, sharing its host memory (default: min(--gpus, 8)).")]
CpOpt = Annotated[Optional[int], typer.Option(
    "--cp", min=1, metavar="N", show_default=False,
    help="Context-parallel degree (default: the recipe's parallel.cp).")]
CheckpointingOpt = Annotated[Optional[Policy], typer.Option(
    "--checkpointing", show_default=False,
    help="Activation checkpointing policy (default: the recipe's train.checkpointing).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
SeqLensOpt = Annotated[str, typer.Option(
    "--seq-len", metavar="SIZES", help="Comma-separated sequence lengths, e.g. 16k,32k,64k.")]
BackendsOpt = Annotated[Optional[str], typer.Option(
    "--backend", metavar="NAMES", show_default=False,
    help=f"Comma-separated local attention backends ({', '.join(ATTENTION_BACKENDS[1:])}); "
         "default: every one available.")]
BackendOpt = Annotated[Optional[str], typer.Option(
    "--backend", metavar="NAME", show_default=False,
    help="Local attention backend inside the distributed attention (default: auto).")]
SchedulesOpt = Annotated[str, typer.Option(
    "--schedule", metavar="NAMES", help=f"Comma-separated schedules: {', '.join(SCHEDULES)}.")]
HeadsOpt = Annotated[int, typer.Option("--heads", min=1, help="Query heads.")]
KvHeadsOpt = Annotated[Optional[int], typer.Option(
    "--kv-heads", min=1, show_default=False, help="Key/value heads (default: --heads).")]
HeadDimOpt = Annotated[int, typer.Option("--head-dim", min=1, help="Head dimension.")]
DTypeOpt = Annotated[DType, typer.Option("--dtype", help="Data type of q, k, v.")]
JsonFileOpt = Annotated[Optional[str], typer.Option(
    "--json", metavar="FILE", show_default=False, help="Also write the results as JSON to FILE.")]
PlotOpt = Annotated[Optional[str], typer.Option(
    "--plot", metavar="FILE.png", show_default=False, help="Also plot the results to FILE.png.")]
