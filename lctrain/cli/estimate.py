"""``lctrain estimate-memory``: per-GPU memory of a recipe at a sequence length."""
from __future__ import annotations

from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from lctrain.cli.common import as_json, user_errors
from lctrain.cli.options import (
    CheckpointingOpt,
    CpOpt,
    GpuMemoryOpt,
    GpusOpt,
    GpusPerNodeOpt,
    HostMemoryOpt,
    JsonFlag,
    ModelOpt,
    RecipeArg,
    SeqLenOpt,
    SetOpt,
)
from lctrain.config import format_bytes, format_tokens, load_recipe, parse_memory, parse_size
from lctrain.errors import ConfigError

_PARTS = ("parameters", "gradients", "optimizer", "activations", "other")


def estimate_memory(recipe: RecipeArg = None, model: ModelOpt = None, seq_len: SeqLenOpt = None,
                    gpus: GpusOpt = 1, gpu_memory: GpuMemoryOpt = "80GiB", cp: CpOpt = None,
                    checkpointing: CheckpointingOpt = None, overrides: SetOpt = None,
                    host_memory: HostMemoryOpt = None, gpus_per_node: GpusPerNodeOpt = None,
                    json_output: JsonFlag = False) -> None:
    """Estimate per-GPU memory (parameters, gradients, optimizer, activations) and the longest
    sequence that fits.

    Examples:

        lctrain estimate-memory llama-7b-256k --seq-len 512k --gpus 8 --gpu-memory 80GiB

        lctrain estimate-memory --model /models/Llama-2-7b-hf --seq-len 128k --gpus 8 --json

        lctrain estimate-memory llama-7b-256k --seq-len 384k --gpus 2 --gpu-memory 139GiB --host-memory 251GiB
    """
    policy = checkpointing.value if checkpointing is not None else None
    with user_errors():
        memory = parse_memory(gpu_memory, what="--gpu-memory")
        host = None if host_memory is None else parse_memory(host_memory, what="--host-memory")
        tokens = None if seq_len is None else parse_size(seq_len, what="--seq-len")
        cfg = _recipe(recipe, model, overrides or [], tokens, cp, policy)
        if tokens is None:
            if cfg is None:
                raise ConfigError("--seq-len is needed with --model (there is no recipe to take "
                                  "it from), e.g. --seq-len 128k")
            tokens = cfg.data.seq_len
        from lctrain.memory import estimate_recipe as estimate

        result = estimate(cfg, model=model, seq_len=tokens, gpus=gpus, gpu_memory=memory, cp=cp,
                          policy=policy, host_memory=host, gpus_per_node=gpus_per_node)
    payload = result.to_json()
    if json_output:
        typer.echo(as_json(payload))
    else:
        Console().print(memory_table(payload if isinstance(payload, dict) else {}, memory))


def _recipe(recipe, model, overrides, tokens, cp, policy):
    """The recipe to estimate, or None when only --model is given."""
    if recipe is None and model is not None:
        if overrides:
            raise ConfigError("--set changes a recipe, but only --model was given; add a RECIPE "
                              "or drop --set")
        return None
    extra = [f"parallel.cp={cp}"] if cp is not None else []
    extra += [f"train.checkpointing={policy}"] if policy is not None else []
    return load_recipe(recipe, [*overrides, *extra], seq_len=tokens)


def memory_table(estimate: dict[str, Any], gpu_memory: int) -> Table:
    """A rich table of ``MemoryEstimate.to_json()``: one row per part, then total and verdict."""
    table = Table(title="Estimated memory per GPU", show_header=True)
    table.add_column("part")
    table.add_column("memory", justify="right")
    per_gpu = estimate.get("per_gpu_bytes", {})
    for part in [*_PARTS, *(k for k in per_gpu if k not in (*_PARTS, "total"))]:
        if part in per_gpu:
            table.add_row(part, format_bytes(per_gpu[part]))
    if "total" in per_gpu:
        table.add_row("[bold]total[/bold]", f"[bold]{format_bytes(per_gpu['total'])}[/bold]")
    table.add_row("GPU memory", format_bytes(gpu_memory))
    details = estimate.get("details") or {}
    if details.get("host_offload"):
        table.add_row("pinned host memory per GPU", format_bytes(details["host_offload"]))
    if details.get("host_offload_per_node") and estimate.get("host_memory"):
        table.add_row("pinned host memory per machine",
                      f"{format_bytes(details['host_offload_per_node'])} of "
                      f"{format_bytes(estimate['host_memory'])}")
    if "fits" in estimate:
        table.add_row("fits", "[green]yes[/green]" if estimate["fits"] else "[red]no[/red]")
    if estimate.get("max_seq_len") is not None:
        longest = int(estimate["max_seq_len"])
        table.add_row("longest sequence that fits", _tokens(longest) if longest else "none")
    if "parameters_count" in estimate:
        table.add_row("parameter count", f"{estimate['parameters_count'] / 1e9:.2f} B")
    if details.get("lora_rank"):
        table.add_row("LoRA trainable", f"{details['trainable_parameters'] / 1e6:.1f} M "
                                        f"(rank {details['lora_rank']})")
    if estimate.get("seq_len"):
        table.add_row("sequence length", _tokens(int(estimate["seq_len"])))
    shown = ("per_gpu_bytes", "fits", "max_seq_len", "parameters_count", "seq_len", "gpu_memory",
             "host_memory")
    for key, value in estimate.items():
        if key not in shown and isinstance(value, (int, float, str, bool)):
            table.add_row(key.replace("_", " "), str(value))
    return table


def _tokens(count: int) -> str:
    """``262144`` -> ``"256k"``; counts that are not whole k as ``"1,780,832"``."""
    text = format_tokens(count)
    return text if not text.isdigit() else f"{count:,}"
