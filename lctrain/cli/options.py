"""Options shared by the commands, as ``Annotated`` aliases; sizes are parsed by the command,
so a bad one is one sentence like every other user error."""
from __future__ import annotations

import enum
from typing import Annotated, Optional

import typer

from lctrain.config.schema import ATTENTION_BACKENDS
from lctrain.memory.presets import PRESETS
from lctrain_kernels.vocabulary import SCHEDULES


class DType(str, enum.Enum):
    """Floating-point types a benchmark can run in."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Format(str, enum.Enum):
    """How a command prints its result on stdout."""

    table = "table"
    markdown = "markdown"
    csv = "csv"
    json = "json"


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
    help=f"A preset ({', '.join(PRESETS)}), a model folder or config.json, or a hub name (online) "
         "instead of a recipe.")]
GpusOpt = Annotated[Optional[int], typer.Option(
    "--gpus", min=1, metavar="N", show_default=False,
    help="Number of GPUs (default: the recipe's dp x cp, or 1 with --model).")]
GpuMemoryOpt = Annotated[str, typer.Option(
    "--gpu-memory", metavar="SIZE", help="Memory per GPU: 80GiB, 80G (1024³ bytes) or 80GB (10⁹).")]
HostMemoryOpt = Annotated[Optional[str], typer.Option(
    "--host-memory", metavar="SIZE", show_default=False,
    help="Host memory per machine (e.g. 251GiB): pinned activations and optimizer states must "
         "fit too, and auto checkpointing and the plan may use it.")]
GpusPerNodeOpt = Annotated[Optional[int], typer.Option(
    "--gpus-per-node", min=1, metavar="N", show_default=False,
    help="GPU processes per machine, sharing its host memory (default: min(--gpus, 8)).")]
CpOpt = Annotated[Optional[int], typer.Option(
    "--cp", min=1, metavar="N", show_default=False,
    help="Context-parallel degree (default: the recipe's parallel.cp).")]
CheckpointingOpt = Annotated[Optional[str], typer.Option(
    "--checkpointing", metavar="none|remat|full|auto|RUNS", show_default=False,
    help="How each layer is kept, e.g. remat or full=4,remat=28 (default: the recipe's "
         "train.checkpointing).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON (the same as --format json).")]
PlanFlag = Annotated[bool, typer.Option(
    "--plan", help="Plan instead: the longest sequence this machine trains and its settings, "
                   "and the fastest settings at --seq-len, as commands to paste.")]
SeqLensOpt = Annotated[Optional[str], typer.Option(
    "--seq-len", metavar="SIZES", show_default=False,
    help="Comma-separated sequence lengths, e.g. 16k,32k,64k (default: sizes that suit the "
         "device; see the command's help).")]
BackendsOpt = Annotated[Optional[str], typer.Option(
    "--backend", metavar="NAMES", show_default=False,
    help=f"Comma-separated local attention backends ({', '.join(ATTENTION_BACKENDS[1:])}) "
         "and peers (flex_attention); default: every fast backend available.")]
BackendOpt = Annotated[Optional[str], typer.Option(
    "--backend", metavar="NAME", show_default=False,
    help="Local attention backend inside the distributed attention (default: auto).")]
SchedulesOpt = Annotated[str, typer.Option(
    "--schedule", metavar="NAMES", help=f"Comma-separated schedules: {', '.join(SCHEDULES)}.")]
HeadsOpt = Annotated[Optional[int], typer.Option(
    "--heads", min=1, metavar="N", show_default=False,
    help="Query heads (default: 32 on a GPU, fewer on a CPU).")]
KvHeadsOpt = Annotated[Optional[int], typer.Option(
    "--kv-heads", min=1, metavar="N", show_default=False,
    help="Key/value heads (default: --heads).")]
HeadDimOpt = Annotated[Optional[int], typer.Option(
    "--head-dim", min=1, metavar="N", show_default=False,
    help="Head dimension (default: 128 on a GPU, smaller on a CPU).")]
DTypeOpt = Annotated[Optional[DType], typer.Option(
    "--dtype", metavar="float32|float16|bfloat16", show_default=False,
    help="Data type of q, k, v (default: bfloat16 on a GPU, float32 on a CPU).")]
RepeatsOpt = Annotated[int, typer.Option(
    "--repeats", min=1, metavar="N", help="Timed iterations per measurement (the median is "
                                          "reported).")]
WarmupOpt = Annotated[int, typer.Option(
    "--warmup", min=0, metavar="N", help="Untimed iterations before timing.")]
_DOCUMENTS_HELP = ("Pack each sequence into documents (document mask; rates count only the pairs "
                   "inside documents): 8 (equal ones), 8x8k, 20k,12k,3x2k,rest, lognormal:mean=12k"
                   "[,sigma=1,seed=0], lengths:FILE[@ROW] or data:FILE[@ROW] (needs --recipe).")
DocumentsOpt = Annotated[Optional[str], typer.Option(
    "--documents", metavar="SPEC", show_default=False, help=_DOCUMENTS_HELP)]
DocumentMixesOpt = Annotated[Optional[list[str]], typer.Option(
    "--documents", metavar="SPEC", show_default=False,
    help=_DOCUMENTS_HELP + " Repeatable: each spec is a mix of its own, side by side.")]
DocumentsRecipeOpt = Annotated[Optional[str], typer.Option(
    "--recipe", metavar="RECIPE", show_default=False,
    help="Recipe whose tokenizer and data settings read a --documents data:FILE spec.")]
ProfileOpt = Annotated[Optional[str], typer.Option(
    "--profile", metavar="DIR", show_default=False,
    help="Also profile each measurement: chrome traces into DIR, time per kernel category "
         "in the table.")]
FormatOpt = Annotated[Format, typer.Option(
    "--format", metavar="table|markdown|csv|json", help="Output on stdout: an aligned table (never cut, also in a pipe), "
                     "Markdown, CSV or the result JSON.")]
WideOpt = Annotated[bool, typer.Option(
    "--wide", help="Show every column (times, spreads, errors, counts), not only the "
                   "compact ones.")]
JsonFileOpt = Annotated[Optional[str], typer.Option(
    "--json", metavar="FILE", show_default=False,
    help="Also write the result JSON to FILE (read it back with lctrain bench report).")]
PlotOpt = Annotated[Optional[str], typer.Option(
    "--plot", metavar="FILE.png", show_default=False,
    help="Also plot the results to FILE.png (needs matplotlib; .pdf and .svg work too).")]
