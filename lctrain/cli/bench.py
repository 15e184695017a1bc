"""``lctrain bench kernel|attention|step|data|report``: measure, compare, plot, report."""
from __future__ import annotations

import typer

from lctrain.cli.options import (BackendOpt, BackendsOpt, DTypeOpt, DocumentMixesOpt, DocumentsOpt,
                                 DocumentsRecipeOpt, Format, FormatOpt, HeadDimOpt, HeadsOpt,
                                 JsonFileOpt, KvHeadsOpt, NprocOpt, PlotOpt, ProfileOpt, RecipeArg,
                                 RepeatsOpt, SchedulesOpt, SeqLenOpt, SeqLensOpt, SetOpt,
                                 WarmupOpt, WideOpt, optional, parsed_size, split_names,
                                 user_errors)
from lctrain.config import load_recipe, parse_size, parse_size_list
from lctrain_kernels.vocabulary import SCHEDULES

app = typer.Typer(help="Measure local attention kernels, the distributed attention and whole "
                       "training steps; turn result files into tables.",
                  no_args_is_help=True, add_completion=False, rich_markup_mode=None)
KernelCheckLenOpt = optional(str, "--check-len", "SIZE", "Length of the correctness check against "
                             "float32 math, e.g. 8k (default: 4k on a GPU, 256 on a CPU; at most "
                             "the shortest --seq-len).")
AttentionCheckLenOpt = optional(str, "--check-len", "SIZE", "Total length of each schedule's "
                                "correctness check against float32 math (default: 2k per rank, at "
                                "most the shortest --seq-len).")
VariantOpt = optional(list[str], "--variant", "'KEY=VALUE ...'", "One configuration to time: "
                      "space-separated overrides on top of --set (repeatable; one row per variant "
                      "and length).")
StepDocumentsOpt = optional(str, "--documents", "SPEC", "Train on rows packed from documents of "
                            "this mix (8x8k, lognormal:median=16k, ...; a lognormal mix draws each "
                            "row anew) of random tokens instead of the recipe's data; "
                            "data.document_mask still decides whether they are kept apart.")
MemoryTraceOpt = optional(str, "--memory-trace", "DIR", "On GPUs, also record the allocator over "
                          "each configuration's last step: a snapshot per rank "
                          "(pytorch.org/memory_viz) and a report of what was alive at the step's "
                          "peak, into DIR/<configuration number>/ (written outside the step's "
                          "time).")
StepProfileOpt = optional(str, "--profile", "DIR", "Also profile each configuration's last step: a "
                          "chrome trace and a kernel summary per rank into DIR/<configuration "
                          "number>/, rank 0's time per kernel category in the row (--wide); "
                          "written outside the step's time.")


@app.command("kernel")
def kernel(seq_len: SeqLensOpt = None, backend: BackendsOpt = None, heads: HeadsOpt = None,
           kv_heads: KvHeadsOpt = None, head_dim: HeadDimOpt = None, dtype: DTypeOpt = None,
           causal: bool = typer.Option(True, "--causal/--full", help="Causal or full attention."),
           documents: DocumentMixesOpt = None, recipe: DocumentsRecipeOpt = None,
           dense_reference: str = typer.Option(
               "auto", "--dense-reference", metavar="NAME",
               help="With --documents, the backend also timed without documents at each "
                    "length; rows get 'of dense', their useful rate over its rate (auto: "
                    "cudnn on a GPU, none on a CPU; none: skip)."),
           check_len: KernelCheckLenOpt = None, repeats: RepeatsOpt = 5, warmup: WarmupOpt = 2,
           profile: ProfileOpt = None, json_file: JsonFileOpt = None, plot: PlotOpt = None,
           fmt: FormatOpt = Format.table, wide: WideOpt = False) -> None:
    """Time one device's attention backends (forward, backward, TFLOP/s).

    With no sizes: 16k, 32k, 64k with 32 heads of 128 in bfloat16 on a GPU; 256 to 1k tokens
    with 8 heads of 64 in float32 on a CPU (seconds).

    With --documents (repeatable) every length is packed documents, rates count useful FLOPs,
    the correctness check runs each mix scaled to --check-len and --dense-reference says how
    close each comes to one dense sequence.

    \b
    Examples:
      lctrain bench kernel --seq-len 16k,32k,64k --backend triton,cudnn --plot kernel.png
      lctrain bench kernel --seq-len 64k --documents 8x8k --documents 32x2k \\
          --backend cudnn_ragged,triton --check-len 8k
    """
    with user_errors():
        from lctrain.bench.kernel import run
        from lctrain.bench.publish import Publisher

        out = Publisher("kernel", fmt.value, wide, json_file, plot)
        result = run(seq_lens=parsed_size(seq_len, "--seq-len", parse_size_list),
                     backends=split_names(backend), heads=heads, kv_heads=kv_heads,
                     head_dim=head_dim, dtype=dtype and dtype.value,
                     causal=causal, documents=documents, dense_reference=dense_reference,
                     recipe=None if recipe is None else load_recipe(recipe), repeats=repeats,
                     warmup=warmup, check_len=parsed_size(check_len, "--check-len"),
                     profile_dir=profile, progress=out.progress)
        out.publish(result)


@app.command("attention")
def attention(seq_len: SeqLensOpt = None, schedule: SchedulesOpt = ",".join(SCHEDULES),
              nproc: NprocOpt = None, heads: HeadsOpt = None, kv_heads: KvHeadsOpt = None,
              head_dim: HeadDimOpt = None, dtype: DTypeOpt = None, backend: BackendOpt = None,
              documents: DocumentsOpt = None, recipe: DocumentsRecipeOpt = None,
              balance_documents: bool = typer.Option(
                  True, "--balance-documents/--packed-order",
                  help="With --documents: give lctrain's schedules the documents in the order "
                       "that evens out the GPUs' work, as training does, or in packed order."),
              overlap_ablation: bool = typer.Option(
                  False, "--overlap-ablation", help="Also run distflash without communication "
                                                    "overlap (and the share hidden)."),
              peers: bool = typer.Option(
                  False, "--peers", help="Also run torch's context_parallel."),
              check_len: AttentionCheckLenOpt = None, repeats: RepeatsOpt = 5,
              warmup: WarmupOpt = 2,
              min_time: float = typer.Option(
                  0.0, "--min-time", min=0.0, metavar="SECONDS",
                  help="Repeat short measurements until about this long (at most 50 times)."),
              single_max_len: str = typer.Option(
                  "256k", "--single-max-len", metavar="SIZE",
                  help="Longest total length also timed on one GPU (the reference)."),
              profile: ProfileOpt = None, json_file: JsonFileOpt = None, plot: PlotOpt = None,
              fmt: FormatOpt = Format.table, wide: WideOpt = False) -> None:
    """Time the distributed attention over NPROC ranks for each schedule (TFLOP/s per GPU, ratio
    to one GPU, balance, communication hidden behind compute).

    Lengths are TOTAL sequences, each rank holds length / NPROC tokens. With no sizes: 64k,
    128k, 256k on every GPU; 256 and 512 tokens on 2 CPU processes.

    With --documents every length is packed documents (the same on every schedule, the
    single-GPU kernel and the correctness check, scaled to --check-len there).

    \b
    Examples:
      lctrain bench attention --seq-len 64k,128k,256k --peers --overlap-ablation --plot a.png
      lctrain bench attention --seq-len 128k --documents lognormal:mean=16k
    """
    with user_errors():
        from lctrain.bench.dist_attention import run
        from lctrain.bench.publish import Publisher

        out = Publisher("attention", fmt.value, wide, json_file, plot)
        result = run(seq_lens=parsed_size(seq_len, "--seq-len", parse_size_list),
                     schedules=split_names(schedule), nproc=nproc, heads=heads,
                     kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype and dtype.value, backend=backend or "auto",
                     documents=documents, recipe=None if recipe is None else load_recipe(recipe),
                     balance_documents=balance_documents, overlap_ablation=overlap_ablation,
                     peers=peers, repeats=repeats, warmup=warmup,
                     check_len=parsed_size(check_len, "--check-len"), min_time_s=min_time,
                     single_max_len=parse_size(single_max_len, what="--single-max-len"),
                     profile_dir=profile, progress=out.progress)
        out.publish(result)


@app.command("step")
def step(recipe: RecipeArg = None, seq_len: SeqLensOpt = None, overrides: SetOpt = None,
         variant: VariantOpt = None,
         steps: int = typer.Option(10, "--steps", min=1, metavar="N", help="Steps to time."),
         warmup: int = typer.Option(1, "--warmup", min=0, metavar="N",
                                    help="Untimed steps first, on the first timed steps' rows "
                                         "(allocator growth, autotuning, compiles)."),
         save_every: int = typer.Option(
             0, "--save-every", min=0, metavar="N",
             help="Also write a checkpoint every N steps (in the background on GPUs), to time "
                  "steps with a save in flight; 0: none."),
         documents: StepDocumentsOpt = None, memory_trace: MemoryTraceOpt = None,
         profile: StepProfileOpt = None,
         nproc: NprocOpt = None, json_file: JsonFileOpt = None, plot: PlotOpt = None,
         fmt: FormatOpt = Format.table, wide: WideOpt = False) -> None:
    """Time whole training steps of a recipe (tokens/s, MFU, peak memory against the
    estimate), at one or more lengths and configurations.

    \b
    Example:
      lctrain bench step llama-7b-64k --seq-len 32k,64k --steps 3 \\
          --variant train.checkpointing=full --variant train.checkpointing=remat
      lctrain bench step llama-7b-64k --steps 6 --save-every 2
      lctrain bench step llama-7b-256k --seq-len 128k --documents lognormal:median=16k \\
          --variant data.document_mask=true --variant data.document_mask=false
    """
    with user_errors():
        from lctrain.bench.publish import Publisher
        from lctrain.bench.step import configurations, run

        out = Publisher("step", fmt.value, wide, json_file, plot)
        lengths = parsed_size(seq_len, "--seq-len", parse_size_list)
        configs = configurations(recipe, overrides or [], lengths, variant)
        result = run(configs, steps=steps, nproc=nproc, warmup=warmup, save_every=save_every,
                     documents=documents, memory_trace=memory_trace, profile=profile,
                     progress=out.progress)
        out.publish(result)


@app.command("data")
def data(recipe: RecipeArg = None, seq_len: SeqLenOpt = None, overrides: SetOpt = None,
         json_file: JsonFileOpt = None, fmt: FormatOpt = Format.table,
         wide: WideOpt = False) -> None:
    """Time preparing a recipe's data on this machine: cold (fresh caches: read, tokenize,
    write the token stream, plan the rows) and warm (a later run's start, from the caches).

    \b
    Example:
      lctrain bench data --set data.source='corpus/*.jsonl' --json data.json
    """
    with user_errors():
        from lctrain.bench.data import run
        from lctrain.bench.publish import Publisher

        out = Publisher("data", fmt.value, wide, json_file)
        out.publish(run(load_recipe(recipe, overrides or [], seq_len=seq_len), out.progress))


@app.command("report")
def report(files: list[str] = typer.Argument(..., metavar="FILE",
                                             help="Result files written by lctrain bench --json."),
           rows: bool = typer.Option(False, "--rows", help="One row per measurement instead of "
                                     "the summary (lengths down, variants across)."),
           json_file: JsonFileOpt = None, plot: PlotOpt = None, fmt: FormatOpt = Format.table,
           wide: WideOpt = False) -> None:
    """Turn result files into the README's tables and plots; several files of one bench are
    merged (e.g. one table measured in parts) and --json writes the merged result. Files of
    lctrain eval --json are shown one after the other, as lctrain eval shows them.

    \b
    Example:
      lctrain bench report docs/performance/*-attention.json --format markdown --plot a.png
    """
    with user_errors():
        from lctrain.bench.publish import Publisher
        from lctrain.bench.result import load, merge
        from lctrain.eval.result import eval_results, show_eval_results

        evaluations = eval_results(files)
        if evaluations:
            show_eval_results(evaluations, fmt.value, wide, rows=rows, json_file=json_file,
                              plot_file=plot)
            return
        result = merge([load(path) for path in files])
        out = Publisher(result.kind, fmt.value, wide, json_file, plot)
        out.publish(result, pivot=not rows, record_command=False)
