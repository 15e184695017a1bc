"""What every command shares: user errors and command-line mistakes as one sentence, and the
options as ``Annotated`` aliases (sizes are parsed by the command, so a bad one is one sentence
like every other user error)."""
from __future__ import annotations

import enum
from contextlib import contextmanager
from typing import Annotated, Iterator, Optional

import typer
from typer.core import TyperGroup

from lctrain.config import parse_size
from lctrain.config.schema import ATTENTION_BACKENDS
from lctrain.errors import as_user_error
from lctrain.memory.presets import PRESETS
from lctrain_kernels.vocabulary import SCHEDULES


# Click's usage error (Typer's BadParameter is one; Typer may carry its own Click)
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class OneLineUsage(TyperGroup):
    """The app's group: a command-line mistake is one line naming ``--help`` (exit code 2)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except UsageError as error:
            raise _usage_exit(error) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as error:
            raise _usage_exit(error, ctx) from None


def _usage_exit(error, ctx=None) -> Exception:
    """Print ``error`` as one sentence naming --help; the exception to raise."""
    if type(error).__name__ == "NoArgsIsHelpError":
        return error
    if error.ctx is not None:
        command = error.ctx.command_path
    elif ctx is not None:
        command = " ".join(filter(None, (ctx.command_path, ctx.invoked_subcommand)))
    else:
        command = "lctrain"
    message = " ".join(error.format_message().split()).rstrip(".")
    message = message[:1].lower() + message[1:]  # click's sentences, said like lctrain's own
    typer.echo(f"error: {message}; see {command} --help", err=True)
    return typer.Exit(error.exit_code)


@contextmanager
def user_errors() -> Iterator[None]:
    """A user error in the block is one line on stderr and exit code 1; bugs keep a traceback."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - filtered right below
        mistake = as_user_error(error)
        if mistake is None:
            raise
        typer.echo(f"error: {' '.join(str(mistake).split())}", err=True)
        raise typer.Exit(1) from None


def parsed_size(text: str | None, what: str, parse=parse_size):
    """``text`` parsed by ``parse`` (ConfigError naming the option ``what``); None stays None."""
    return None if text is None else parse(text, what=what)


def split_names(text: str | None) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; None stays None."""
    return None if text is None else [item.strip() for item in text.split(",") if item.strip()]


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


def optional(kind, name: str, metavar: str | None, help: str, **more):
    """An option that is None unless given (no default shown): its ``Annotated`` alias."""
    return Annotated[Optional[kind], typer.Option(name, metavar=metavar, show_default=False,
                                                  help=help, **more)]


RecipeArg = Annotated[Optional[str], typer.Argument(
    metavar="RECIPE", show_default=False,
    help="Recipe YAML file or shipped recipe name (tiny, llama-7b-64k, ...); default: the "
         "embedded tiny recipe.")]
SeqLenOpt = optional(str, "--seq-len", "SIZE",
                     "Sequence length (data.seq_len), e.g. 4096, 64k, 256k, 1m (k = 1024).")
SetOpt = optional(list[str], "--set", "KEY=VALUE", "Override one recipe setting, e.g. --set "
                  "train.lr=1e-5 (repeatable; values are YAML).")
OutputDirOpt = optional(str, "--output-dir", "DIR", "Where the run writes config.yaml, "
                        "metrics.jsonl and checkpoints/ (train.output_dir).")
MaxStepsOpt = optional(int, "--max-steps", "N", "Optimizer steps (train.max_steps).", min=1)
StepOpt = optional(int, "--step", "N", "The run's checkpoint of step N (default: the newest).",
                   min=0)
ResumeOpt = Annotated[bool, typer.Option(
    "--resume", help="Continue from the latest checkpoint in the output folder.")]
NprocOpt = optional(int, "--nproc", "N", "Processes to launch on this machine (default: one per "
                    "GPU; on a CPU: parallel.cp).", min=1)
ModelOpt = optional(str, "--model", "NAME|PATH", f"A preset ({', '.join(PRESETS)}), a model folder "
                    "or config.json, or a hub name (online) instead of a recipe.")
GpusOpt = optional(int, "--gpus", "N",
                   "Number of GPUs (default: the recipe's dp x cp, or 1 with --model).", min=1)
GpuMemoryOpt = Annotated[str, typer.Option(
    "--gpu-memory", metavar="SIZE", help="Memory per GPU: 80GiB, 80G (1024³ bytes) or 80GB (10⁹).")]
HostMemoryOpt = optional(str, "--host-memory", "SIZE", "Host memory per machine (e.g. 251GiB): "
                         "pinned activations and optimizer states must fit too, and auto "
                         "checkpointing and the plan may use it.")
GpusPerNodeOpt = optional(int, "--gpus-per-node", "N", "GPU processes per machine, sharing its "
                          "host memory (default: min(--gpus, 8)).", min=1)
CpOpt = optional(int, "--cp", "N", "Context-parallel degree (default: the recipe's parallel.cp; "
                 "with --model alone, the smallest that fits).", min=1)
CheckpointingOpt = optional(str, "--checkpointing", "none|remat|full|auto|RUNS", "How each layer "
                            "is kept, e.g. remat or full=4,remat=28 (default: the recipe's "
                            "train.checkpointing; auto with --model alone).")
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON (the same as --format json).")]
PlanFlag = Annotated[bool, typer.Option(
    "--plan", help="Plan instead: the longest sequence this machine trains and its settings, "
                   "and the fastest settings at --seq-len, as commands to paste.")]
MixOpt = optional(str, "--documents", "SPEC", "Time the step for rows packed from documents of "
                  "this mix (8x8k, lognormal:median=16k, lengths:FILE, ...); memory still "
                  "budgets one document.")
SeqLensOpt = optional(str, "--seq-len", "SIZES", "Comma-separated sequence lengths, e.g. "
                      "16k,32k,64k (default: sizes that suit the device; see the command's help).")
BackendsOpt = optional(str, "--backend", "NAMES", "Comma-separated local attention backends "
                       f"({', '.join(ATTENTION_BACKENDS[1:])}); "
                       "default: every fast backend available.")
BackendOpt = optional(str, "--backend", "NAME",
                      "Local attention backend inside the distributed attention (default: auto).")
SchedulesOpt = Annotated[str, typer.Option(
    "--schedule", metavar="NAMES", help=f"Comma-separated schedules: {', '.join(SCHEDULES)}.")]
HeadsOpt = optional(int, "--heads", "N", "Query heads (default: 32 on a GPU, fewer on a CPU).",
                    min=1)
KvHeadsOpt = optional(int, "--kv-heads", "N", "Key/value heads (default: --heads).", min=1)
HeadDimOpt = optional(int, "--head-dim", "N",
                      "Head dimension (default: 128 on a GPU, smaller on a CPU).", min=1)
DTypeOpt = optional(DType, "--dtype", "float32|float16|bfloat16",
                    "Data type of q, k, v (default: bfloat16 on a GPU, float32 on a CPU).")
RepeatsOpt = Annotated[int, typer.Option(
    "--repeats", min=1, metavar="N", help="Timed iterations per measurement (the median is "
                                          "reported).")]
WarmupOpt = Annotated[int, typer.Option(
    "--warmup", min=0, metavar="N", help="Untimed iterations before timing.")]
_DOCUMENTS_HELP = ("Pack each sequence into documents (document mask; rates count only the pairs "
                   "inside documents): 8 (equal ones), 8x8k, 20k,12k,3x2k,rest, lognormal:mean=12k"
                   "[,sigma=1,seed=0], lengths:FILE[@ROW] or data:FILE[@ROW] (needs --recipe).")
DocumentsOpt = optional(str, "--documents", "SPEC", _DOCUMENTS_HELP)
DocumentMixesOpt = optional(list[str], "--documents", "SPEC", _DOCUMENTS_HELP + " Repeatable: "
                            "each spec is a mix of its own, side by side.")
DocumentsRecipeOpt = optional(str, "--recipe", "RECIPE", "Recipe whose tokenizer and data "
                              "settings read a --documents data:FILE spec.")
ProfileOpt = optional(str, "--profile", "DIR", "Also profile each measurement: chrome traces "
                      "into DIR, time per kernel category in the table.")
FormatOpt = Annotated[Format, typer.Option(
    "--format", metavar="table|markdown|csv|json", help="Output on stdout: an aligned table (never cut, also in a pipe), "
                     "Markdown, CSV or the result JSON.")]
WideOpt = Annotated[bool, typer.Option(
    "--wide", help="Show every column (times, spreads, errors, counts), not only the "
                   "compact ones.")]
JsonFileOpt = optional(str, "--json", "FILE", "Also write the result JSON to FILE (read it back "
                       "with lctrain bench report).")
PlotOpt = optional(str, "--plot", "FILE.png",
                   "Also plot the results to FILE.png (needs matplotlib; .pdf and .svg work too).")
