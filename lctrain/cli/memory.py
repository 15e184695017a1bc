"""``lctrain estimate-memory``: per-GPU memory of a recipe at a sequence length."""
from __future__ import annotations

import json
import os

import typer

from lctrain.cli.options import (CheckpointingOpt, CpOpt, Format, FormatOpt, GpuMemoryOpt, GpusOpt,
                                 GpusPerNodeOpt, HostMemoryOpt, JsonFlag, MixOpt, ModelOpt,
                                 PlanFlag, RecipeArg, SeqLenOpt, SetOpt, WideOpt, parsed_size,
                                 user_errors)
from lctrain.bench.documents import attended_share
from lctrain.config import load_recipe, parse_memory
from lctrain.config.hub import check_hub_model, looks_like_hub_name
from lctrain.errors import ConfigError
from lctrain.memory.presets import PRESETS


def estimate_memory(recipe: RecipeArg = None, model: ModelOpt = None, seq_len: SeqLenOpt = None,
                    gpus: GpusOpt = None, gpu_memory: GpuMemoryOpt = "80GiB", cp: CpOpt = None,
                    checkpointing: CheckpointingOpt = None, overrides: SetOpt = None,
                    host_memory: HostMemoryOpt = None, gpus_per_node: GpusPerNodeOpt = None,
                    json_output: JsonFlag = False, fmt: FormatOpt = Format.table,
                    wide: WideOpt = False, plan: PlanFlag = False,
                    documents: MixOpt = None) -> None:
    """Estimate per-GPU memory (parameters, gradients, optimizer, activations) and the longest
    sequence that fits. With no arguments: the embedded tiny recipe on its own GPU count.
    With --plan: the longest sequence the machine can train and the settings that reach it,
    and the fastest settings at --seq-len, each as a command to paste; with --documents, the
    fastest for that mix of documents.

    \b
    Examples:
      lctrain estimate-memory llama-7b-256k --seq-len 512k --gpus 8 --gpu-memory 80GiB
      lctrain estimate-memory --model llama3-8b --seq-len 128k --gpus 8 --cp 8
      lctrain estimate-memory --model /models/Llama-2-7b-hf --seq-len 128k --gpus 8 --json
      lctrain estimate-memory llama-7b-256k --seq-len 384k --gpus 2 --gpu-memory 139GiB \\
          --host-memory 251GiB
      lctrain estimate-memory llama-7b-256k --plan --seq-len 1m --gpus 2 --gpu-memory 139GiB \\
          --host-memory 251GiB
      lctrain estimate-memory llama3.1-8b-random-128k --plan --gpus 2 --gpu-memory 139GiB \\
          --host-memory 251GiB --documents lognormal:median=4k
    """
    with user_errors():
        if plan and (cp is not None or checkpointing is not None):
            raise ConfigError("--plan chooses cp and checkpointing itself; drop --cp and "
                              "--checkpointing (or estimate one setup without --plan)")
        as_json = json_output or fmt == Format.json
        memory = parse_memory(gpu_memory, what="--gpu-memory")
        host = parsed_size(host_memory, "--host-memory", parse_memory)
        tokens = parsed_size(seq_len, "--seq-len")
        # --plan varies the length itself: the recipe keeps its own
        cfg = _recipe(recipe, model, overrides or [], None if plan else tokens, cp, checkpointing)
        if gpus is None:  # the recipe's own layout, or one GPU for a bare model
            gpus = 1 if cfg is None else cp or cfg.parallel.cp
        if plan:
            return _plan(cfg, recipe, model, overrides or [], tokens, gpus, memory, host,
                         gpus_per_node, documents, as_json, fmt, wide)
        if tokens is None:
            if cfg is None:
                raise ConfigError("--seq-len is needed with --model (there is no recipe to take "
                                  "it from), e.g. --seq-len 128k")
            tokens = cfg.data.seq_len
        from lctrain.memory import estimate_recipe as estimate

        result = estimate(cfg, model=model, seq_len=tokens, gpus=gpus, gpu_memory=memory, cp=cp,
                          checkpointing=checkpointing, host_memory=host, gpus_per_node=gpus_per_node,
                          attended=attended_share(documents, tokens, recipe=cfg))
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2, default=str))
        return
    from lctrain.report.table import show
    from lctrain.memory.tables import estimate_table

    show(estimate_table(result.to_json(), memory), fmt.value, wide)


def _plan(cfg, recipe, model, overrides, tokens, gpus, memory, host, gpus_per_node, documents,
          as_json, fmt, wide) -> None:
    """--plan: plan (`lctrain.memory.recipe.plan_recipe`), render the table and commands."""
    if tokens is None and recipe is not None:
        tokens = cfg.data.seq_len
    if documents is not None and tokens is None:
        raise ConfigError("--documents times the fastest settings at --seq-len; give one, "
                          "e.g. --seq-len 128k")
    from lctrain.memory import plan_recipe
    from lctrain.memory.recipe import run_settings
    from lctrain.memory.tables import plan_commands, plan_table
    from lctrain.report.table import show

    result = plan_recipe(cfg, model=model, gpus=gpus, gpu_memory=memory, host_memory=host,
                         gpus_per_node=gpus_per_node, seq_len=tokens,
                         attended=attended_share(documents, tokens, recipe=cfg))
    settings = [*overrides, *run_settings(cfg, recipe, model)]
    result["commands"] = plan_commands(result, recipe, settings)
    if as_json:
        typer.echo(json.dumps(result, indent=2, default=str))
        return
    show(plan_table(result), fmt.value, wide)
    for name, command in result["commands"].items():  # on stderr beside CSV, which is data
        typer.echo(f"\n{name}:\n  {command}", err=fmt == Format.csv)


def _recipe(recipe, model, overrides, tokens, cp, checkpointing):
    """The recipe to estimate, or None when only --model is given (a hub name is checked)."""
    if model is not None and model not in PRESETS and looks_like_hub_name(model) \
            and not os.path.exists(os.path.expanduser(model)):
        check_hub_model(model, what="--model")
    if recipe is None and model is not None:
        if overrides:
            raise ConfigError("--set changes a recipe, but only --model was given; add a RECIPE "
                              "or drop --set")
        return None
    extra = [f"parallel.cp={cp}"] if cp is not None else []
    extra += [f"train.checkpointing={checkpointing}"] if checkpointing is not None else []
    return load_recipe(recipe, [*overrides, *extra], seq_len=tokens)
