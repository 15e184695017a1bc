"""`MemoryEstimate`, the memory model's result, and its tables: the JSON form rendered as
``--format json`` writes it (`estimate_table`), a plan with one column per choice
(`plan_table`) and the commands that run a plan (`plan_commands`)."""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field

from lctrain.config.fields import format_bytes, format_tokens
from lctrain.report.human import parameters, tokens
from lctrain.report.table import Column, Table

COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "other")
def step_note(attended: float, which: str = "step time is") -> str:
    """What the step time assumes of the rows' documents (`Setup.attended`)."""
    if attended >= 1.0:
        return ("step time is for rows that are one document: packed documents, masked apart, "
                "attend less and train faster (--documents SPEC times a mix)")
    return (f"{which} for rows whose documents attend {attended:.1%} of a one-document row's "
            f"pairs; memory still budgets a row of one document")


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-GPU memory of one step: setup, parts, details, and whether (and how far) it fits."""

    model: str
    parameters_count: int
    seq_len: int
    gpus: int
    cp: int
    policy: str
    dtype: str
    master_dtype: str
    gpu_memory: int | None
    per_gpu_bytes: dict[str, int]
    details: dict = field(default_factory=dict)
    host_memory: int | None = None
    fits: bool | None = None
    max_seq_len: int | None = None
    assumptions: list[str] = field(default_factory=list)
    """What was assumed where neither a recipe nor an option said (a bare ``--model``)."""

    def to_json(self) -> dict:
        """A JSON-ready dict; ``per_gpu_bytes`` keys are the components plus ``total``."""
        return dataclasses.asdict(self)


def estimate_table(estimate: dict, gpu_memory: int | None = None) -> Table:
    """A two-column table (what, amount) of ``MemoryEstimate.to_json()`` (missing keys: no row)."""
    per_gpu = estimate.get("per_gpu_bytes") or {}
    details = estimate.get("details") or {}
    gpu_memory = gpu_memory or estimate.get("gpu_memory")
    rows = [{"what": part, "bytes": per_gpu[part]} for part in (*COMPONENTS, "total")
            if part in per_gpu]
    if gpu_memory:
        rows.append({"what": "GPU memory", "bytes": gpu_memory})
    if details.get("host_offload"):
        rows.append({"what": "host per GPU (offloaded)", "bytes": details["host_offload"]})
    if details.get("host_offload_per_node") and estimate.get("host_memory"):
        rows.append({"what": "host memory per machine (offloaded)",
                     "bytes": details["host_offload_per_node"]})
        rows.append({"what": "host memory per machine", "bytes": estimate["host_memory"]})
    facts = []
    if estimate.get("fits") is not None:
        facts.append(("fits", "yes" if estimate["fits"] else "NO"))
    if estimate.get("max_seq_len") is not None:
        longest = int(estimate["max_seq_len"])
        facts.append(("longest sequence that fits", tokens(longest) if longest else "none"))
    if estimate.get("parameters_count") is not None:
        facts.append(("parameters", parameters(int(estimate["parameters_count"]))))
    if details.get("lora_rank"):
        facts.append(("LoRA trainable", f"{parameters(int(details['trainable_parameters']))} "
                                        f"(rank {details['lora_rank']})"))
    if estimate.get("seq_len"):
        facts.append(("sequence length", tokens(int(estimate["seq_len"]))))
    facts += [(key.replace("_", " "), str(estimate[key]))
              for key in ("model", "gpus", "cp", "dtype", "master_dtype")
              if estimate.get(key) is not None]
    if details.get("checkpointing"):
        placed = " (placed by auto)" if estimate.get("policy") == "auto" else ""
        facts.append(("checkpointing", details["checkpointing"] + placed))
    facts += [(key.replace("_", " "), str(details[key])) for key, default in
              (("offload", "none"), ("tile_tokens", 0), ("head_groups", 1))
              if details.get(key, default) != default]
    if details.get("phase"):
        facts.append(("peak during", str(details["phase"])))
    notes = [f"assumed {text}" for text in estimate.get("assumptions") or []]
    if details.get("step_seconds"):
        facts.append(("step time (est.)", f"{details['step_seconds']:,.1f} s"))
        notes.append(step_note(details.get("attended", 1.0)))
    for row in rows:
        row["amount"] = format_bytes(row["bytes"])
    rows += [{"what": what, "amount": value} for what, value in facts]
    columns = [Column("what", "per GPU"), Column("amount", "amount", "figure"),
               Column("bytes", "bytes", "number", compact=False)]
    return Table(title="Estimated memory per GPU", columns=columns, rows=rows, keys=1, notes=notes)


_PLAN_ROWS = (("sequence length", "seq_len", "tokens"), ("cp x dp", None, "parallel"),
              ("checkpointing", "checkpointing", None), ("offload", "offload", None),
              ("tile tokens", "tile_tokens", "tokens"), ("head groups", "head_groups", None),
              ("GPU memory, total", "total", "bytes"),
              ("GPU peak allocated", "peak_allocated", "bytes"),
              ("host memory per GPU", "host_offload", "bytes"),
              ("step time (est.)", "step_s", "time"),
              ("tokens/s (est.)", "tokens_per_s", "rate"))


def plan_table(plan: dict) -> Table:
    """A table of a plan: one column per choice, one row per setting or figure."""
    machine = plan["machine"]
    host = machine.get("host_memory")
    gpus = f"{machine['gpus']} x {format_bytes(machine['gpu_memory'])}"
    hosts = f"{format_bytes(host)} host memory" if host else "no host memory"
    title = (f"Plan for {plan['model']} on {gpus} GPUs, {hosts} per machine "
             f"({machine['gpus_per_node']} GPUs each)")
    choices = [("longest", "longest", plan.get("longest"))]
    if plan.get("seq_len"):
        choices.append(("fastest", f"fastest at {tokens(plan['seq_len'])}", plan.get("fastest")))
    rows = [{"what": label, **{name: _plan_cell(choice, key, kind) if choice is not None
                               else "does not fit" if key == "seq_len" else "-"
                               for name, _, choice in choices}}
            for label, key, kind in _PLAN_ROWS]
    columns = [Column("what", "setting")] + [Column(name, header, "figure")
                                             for name, header, _ in choices]
    return Table(title=title, columns=columns, rows=rows, keys=1,
                 notes=["estimates: lctrain.memory (memory) and lctrain.memory.timing (time)",
                        step_note(plan.get("attended", 1.0), "the longest's step time is for "
                                  "rows of one document, the fastest's")])


def _plan_cell(choice: dict, key: str | None, kind: str | None) -> str:
    if kind == "parallel":
        return f"{choice['cp']} x {choice['dp']}"
    value = choice["per_gpu_bytes"]["total"] if key == "total" else choice[key]
    if kind == "tokens":
        return tokens(int(value)) if value else "untiled"
    if kind == "bytes":
        return format_bytes(value)
    if kind == "time":
        return f"{value:,.0f} s" if value >= 10 else f"{value:.2g} s"
    if kind == "rate":
        return f"{value:,.0f}"
    return str(value)


def plan_commands(plan: dict, recipe: str | None, overrides: list[str]) -> dict[str, str]:
    """``lctrain finetune`` command lines that run each choice of a plan (``recipe`` None: the
    embedded one), with the ``--set`` ``overrides`` before the plan's own."""
    host = plan["machine"].get("host_memory")
    commands = {}
    for name in ("longest", "fastest"):
        choice = plan.get(name)
        if choice is None:
            continue
        items = [*overrides, *choice["overrides"]]
        if host:  # whole GiB as the recipe takes it (251GiB), else bytes
            items.append(f"train.host_memory={host >> 30}GiB" if host % (1 << 30) == 0
                         else f"train.host_memory={host}")
        args = ["lctrain", "finetune", *([recipe] if recipe else []), "--seq-len",
                format_tokens(choice["seq_len"])]
        args += [part for item in items for part in ("--set", item)]
        commands[f"{name} ({tokens(choice['seq_len'])} tokens)"] = shlex.join(args)
    return commands
