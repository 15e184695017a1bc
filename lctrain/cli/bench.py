"""``lctrain bench kernel|attention|step``: measure, compare, plot."""
from __future__ import annotations

from typing import Any

import typer
from rich.console import Console

from lctrain.cli.common import as_json, fail, split_names, user_errors, write_text
from lctrain.cli.options import (
    BackendOpt,
    BackendsOpt,
    DType,
    DTypeOpt,
    HeadDimOpt,
    HeadsOpt,
    JsonFileOpt,
    KvHeadsOpt,
    NprocOpt,
    PlotOpt,
    RecipeArg,
    SchedulesOpt,
    SeqLenOpt,
    SeqLensOpt,
    SetOpt,
)
from lctrain.config import load_recipe, parse_size, parse_size_list
from lctrain_kernels.vocabulary import SCHEDULES

app = typer.Typer(help="Measure local attention kernels, the distributed attention and whole "
                       "training steps.", no_args_is_help=True, add_completion=False,
                  rich_markup_mode="markdown")


@app.command("kernel")
def kernel(seq_len: SeqLensOpt = "4k,8k,16k", backend: BackendsOpt = None, heads: HeadsOpt = 32,
           head_dim: HeadDimOpt = 128, dtype: DTypeOpt = DType.bfloat16,
           causal: bool = typer.Option(True, help="Causal mask."),
           documents: int = typer.Option(0, min=0, help="Packed documents per sequence (0 = one)."),
           check_len: str = typer.Option(
               "256", metavar="SIZE", help="Sequence length of each backend's correctness check "
               "against float32 math, e.g. 8k (at most the shortest --seq-len)."),
           json_file: JsonFileOpt = None, plot: PlotOpt = None) -> None:
    """Time one GPU's attention backends (forward + backward, TFLOP/s).

    Example: lctrain bench kernel --seq-len 16k,32k --backend triton,flash --plot kernel.png
    """
    with user_errors():
        seq_lens = parse_size_list(seq_len, what="--seq-len")
        check = parse_size(check_len, what="--check-len")
        from lctrain.bench.kernel import run

        result = run(seq_lens=seq_lens, backends=split_names(backend), heads=heads,
                     head_dim=head_dim, dtype=dtype.value, causal=causal,
                     documents=documents or None, check_len=check)
        publish(result, json_file, plot, "bench kernel")


@app.command("attention")
def attention(seq_len: SeqLensOpt = "16k,32k,64k", schedule: SchedulesOpt = ",".join(SCHEDULES),
              nproc: NprocOpt = None, heads: HeadsOpt = 32, kv_heads: KvHeadsOpt = None,
              head_dim: HeadDimOpt = 128, dtype: DTypeOpt = DType.bfloat16,
              backend: BackendOpt = None,
              overlap_ablation: bool = typer.Option(
                  False, help="Also run every schedule without communication overlap."),
              peers: bool = typer.Option(
                  False, help="Also run peer implementations (e.g. torch context_parallel)."),
              json_file: JsonFileOpt = None, plot: PlotOpt = None) -> None:
    """Time the distributed attention over NPROC ranks for each schedule (TFLOP/s, balance,
    communication hidden behind compute).

    Example: lctrain bench attention --seq-len 64k,128k,256k --nproc 8 --plot attention.png
    """
    with user_errors():
        seq_lens = parse_size_list(seq_len, what="--seq-len")
        from lctrain.bench.attention import run

        extra = {} if backend is None else {"backend": backend}
        result = run(seq_lens=seq_lens, schedules=split_names(schedule), nproc=nproc, heads=heads,
                     kv_heads=kv_heads or heads, head_dim=head_dim, dtype=dtype.value,
                     overlap_ablation=overlap_ablation, peers=peers, **extra)
        publish(result, json_file, plot, "bench attention")


@app.command("step")
def step(recipe: RecipeArg = None, seq_len: SeqLenOpt = None, overrides: SetOpt = None,
         steps: int = typer.Option(10, "--steps", min=1, help="Training steps to time."),
         warmup: int = typer.Option(1, "--warmup", min=0,
                                    help="Untimed steps first (allocator growth, autotuning)."),
         nproc: NprocOpt = None, json_file: JsonFileOpt = None, plot: PlotOpt = None) -> None:
    """Time whole training steps of a recipe (tokens/s, MFU, peak memory).

    Example: lctrain bench step llama-7b-64k --seq-len 64k --steps 5
    """
    with user_errors():
        cfg = load_recipe(recipe, overrides or [], seq_len=seq_len)
        from lctrain.bench.step import run

        result = run(cfg, steps=steps, nproc=nproc, warmup=warmup)
        publish(result, json_file, plot, "bench step")


def publish(result: Any, json_file: str | None, plot: str | None, command: str) -> None:
    """Print the result's table; write its JSON and plot when asked."""
    Console().print(result.table())
    if json_file is not None:
        write_text(json_file, as_json(result.to_json()))
    if plot is not None:
        if not callable(getattr(result, "plot", None)):
            raise fail(f"lctrain {command} has nothing to plot; drop --plot")
        result.plot(plot)
