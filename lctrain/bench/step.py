"""``lctrain bench step``: time whole training steps of a recipe through the real runner.

Each configuration (the recipe at one sequence length with one group of ``--set`` overrides,
see :func:`configurations`) runs unchanged through `lctrain.train.runner.finetune` (same
model, data, parallel layout, checkpointing policy and loop as ``lctrain finetune``) for
``warmup + steps`` optimizer steps into a scratch output folder; the runner's
``metrics.jsonl`` is read back and the first ``warmup`` steps (allocator growth, autotuning)
are dropped. One row per configuration, median over the timed steps:

- tokens/s of the whole job, and step time;
- MFU as the runner logs it (``lctrain.train.metrics``): 6·N per token plus the attention FLOPs
  of the documents actually trained on (7·Σ n²·H·D·L for causal documents of n tokens, the
  model of `lctrain.model.flops`), over GPUs × the GPU's dense bf16 peak; recomputation is not
  counted as useful work;
- peak memory, the largest of any rank (the CUDA allocator's peak; on a CPU the process's peak
  RSS) beside the memory model's prediction for the same recipe
  (`lctrain.memory.estimate_recipe`: ``details.peak_allocated``, the figure comparable with
  ``torch.cuda.max_memory_allocated``); on GPUs also the host memory rank 0 keeps for training
  (pinned activations and state, ``host_memory_bytes``) beside the model's ``host_offload``;
- attention forwards per optimizer step: the runner's ``attention_forward_calls`` (counted by
  `lctrain.parallel.activation_checkpoint.AttentionCounter` on the run's first step, on every rank);
  beside the expected L (none, remat, remat-offload) or 2·L (full) per micro-step.

A configuration that cannot run (out of memory, refused for host memory, a bad override) gives
a row whose status says why; the others still run. The training runs' own output goes to
stderr, so stdout carries only the result.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from lctrain.bench.documents import training_rows
from lctrain.bench.result import BenchResult
from lctrain.config import RecipeConfig, load_recipe
from lctrain.config.tiers import parse_layer_policies
from lctrain.model import load_tokenizer
from lctrain.errors import UserError
from lctrain.memory.tiers import chained_layers, recomputed_layers
from lctrain.report.versions import environment
from lctrain.train.memory_trace import ENV as MEMORY_TRACE
from lctrain.train.step_profile import ENV as STEP_PROFILE

_GIB = float(1 << 30)


def configurations(recipe: str | None, overrides: list[str], seq_lens: list[int | None],
                   variants: list[str] | None = None) -> list[tuple[str, RecipeConfig]]:
    """The recipe at every sequence length × every variant, resolved.

    Args:
        recipe: a recipe file or shipped name (None: the embedded tiny recipe).
        overrides: ``--set`` overrides applied to every configuration.
        seq_lens: sequence lengths (None in the list: the recipe's own).
        variants: groups of extra overrides, each one text of space-separated ``key=value``
            items (shell quoting allowed), e.g. ``"train.checkpointing=remat
            parallel.schedule=zigzag"``; None or empty: one configuration per length.

    Returns:
        ``(label, config)`` pairs; the label is the variant's text ("" without variants).

    Raises:
        ConfigError: a bad recipe, override or length (one sentence).
    """
    groups = variants or [""]
    out = []
    for seq_len in seq_lens or [None]:
        for group in groups:
            extra = shlex.split(group)
            out.append((group, load_recipe(recipe, [*overrides, *extra], seq_len=seq_len)))
    return out


def run(configs: RecipeConfig | list[tuple[str, RecipeConfig]], steps: int,
        nproc: int | None = None, *, warmup: int = 1, save_every: int = 0,
        documents: str | None = None, memory_trace: str | None = None,
        profile: str | None = None, progress: Callable[[str], None] | None = None
        ) -> BenchResult:
    """Run ``warmup + steps`` training steps of every configuration and report them.

    Args:
        configs: one resolved recipe, or ``(label, recipe)`` pairs (:func:`configurations`);
            each recipe's output_dir only holds a scratch folder.
        steps: optimizer steps to time (≥ 1).
        nproc: processes (default as ``lctrain finetune``: all GPUs, or dp × cp on a CPU).
        warmup: untimed steps first.
        save_every: also checkpoint every N steps (0: never), as ``checkpoint.asynchronous``
            says (in the background or not): the steps are then timed with saves in flight,
            ``checkpoint_s`` is how long the loop waited for each save, and the step time is
            also split into the steps right after a save started (``step_after_save_s``: in
            the background, the save is written meanwhile) and the others
            (``step_without_save_s``).
        documents: train on rows packed from documents of this ``--documents`` mix
            (`lctrain.bench.documents.training_rows`: a log-normal mix draws every row anew)
            of random token ids, instead of the recipe's data; the recipe's
            ``data.document_mask`` says whether attention keeps them apart.
        memory_trace: a folder: each configuration's last step records the GPU allocator
            into its numbered subfolder (`lctrain.train.memory_trace`; nothing on a CPU).
        profile: a folder: each configuration's last step runs under the profiler, every rank
            writing a chrome trace and a kernel summary into its numbered subfolder
            (`lctrain.train.step_profile`); rank 0's wall and category times join the row
            (``profile_<category>_ms``).
        progress: called with one line before and after each configuration.

    Returns:
        A BenchResult of kind "step" with one row per configuration.

    Raises:
        UserError: steps < 1, warmup < 0 or save_every < 0.
    """
    if steps < 1 or warmup < 0 or save_every < 0:
        raise UserError(f"bench step needs at least 1 timed step (got {steps}), a warm-up of 0 "
                        f"or more (got {warmup}) and a save interval of 0 or more (got "
                        f"{save_every})")
    if isinstance(configs, RecipeConfig):
        configs = [("", configs)]
    say = progress or (lambda line: None)
    rows = []
    for index, (label, cfg) in enumerate(configs, 1):
        n = nproc if nproc is not None else _default_nproc(cfg)
        head = f"configuration {index}/{len(configs)}: {cfg.data.seq_len} tokens" + (
            f", {label}" if label else "")
        say(f"{head}: {warmup} warm-up + {steps} timed steps on {n} processes")
        row = {"variant": label, "seq_len": cfg.data.seq_len}
        try:
            trace = None if memory_trace is None else os.path.join(memory_trace, str(index))
            kernels = None if profile is None else os.path.join(profile, str(index))
            with _environment(MEMORY_TRACE, trace), _environment(STEP_PROFILE, kernels):
                row.update(_one(cfg, n, steps, warmup, save_every, documents))
            if kernels is not None:
                row.update(_profile_fields(Path(kernels), warmup + steps))
        except UserError as exc:
            row.update(status=str(exc))
        except torch.cuda.OutOfMemoryError:
            row.update(status=f"out of memory at {cfg.data.seq_len} tokens")
        say(f"{head}: {_progress_line(row)}")
        rows.append(row)
    meta = _meta(configs[0][1], nproc, warmup, steps, save_every)
    if documents is not None:
        meta["documents"] = documents
    return BenchResult(kind="step", title="training steps", rows=rows, meta=meta)


def _default_nproc(cfg: RecipeConfig) -> int:
    from lctrain.train.runner import default_nproc

    return default_nproc(cfg)


def _one(cfg: RecipeConfig, nproc: int, steps: int, warmup: int, save_every: int,
         documents: str | None = None) -> dict:
    """One configuration's row fields (raises UserError when it cannot run)."""
    from lctrain.launch.launcher import keep_workers_log
    from lctrain.train.runner import finetune

    layers, predicted = _expectations(cfg, nproc)  # before the run: a bad model fails fast
    scratch = Path(tempfile.mkdtemp(prefix=".bench-step-", dir=_parent(cfg)))
    data = None if documents is None else Path(tempfile.mkdtemp(prefix=".bench-data-",
                                                                dir=_parent(cfg)))
    mix = {}
    try:
        if data is not None:
            cfg, mix = _with_documents(cfg, data, documents, nproc, warmup + steps)
        with _stdout_to_stderr():
            code = finetune(_bench_recipe(cfg, scratch, warmup + steps, save_every),
                            nproc=nproc, own_process=True)
        if code != 0:
            kept = keep_workers_log(scratch)
            where = "the output above" if kept is None else f"its workers' log, kept at {kept},"
            raise UserError(f"the benchmarked training run failed with exit code {code}; "
                            f"{where} says why")
        records = _read_metrics(scratch / "metrics.jsonl")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if data is not None:
            shutil.rmtree(data, ignore_errors=True)
    return (_row(cfg, nproc, records, warmup, layers, predicted) | mix
            | _saves(records, warmup, save_every))


def _with_documents(cfg: RecipeConfig, folder: Path, spec: str, nproc: int,
                    steps: int) -> tuple[RecipeConfig, dict]:
    """The recipe reading rows packed from documents of ``spec`` (a tokenized JSONL file of
    random ids in ``folder``, one row's documents after another), and the row fields naming
    the mix."""
    dp = cfg.parallel.dp or max(1, nproc // cfg.parallel.cp)
    count = steps * dp * cfg.train.batch_size * cfg.train.grad_accum
    rows = training_rows(spec, cfg.data.seq_len, count)
    vocab = min(len(load_tokenizer(cfg)), 32000)
    rng = np.random.default_rng(0)
    with (folder / "documents.jsonl").open("w") as f:
        for row in rows:
            for n in row.lengths:
                f.write(json.dumps({"input_ids": rng.integers(3, vocab, n).tolist()}) + "\n")
    data = dataclasses.replace(cfg.data, source=str(folder / "documents.jsonl"),
                               format="tokenized", long_samples="split",
                               cache_dir=str(folder / "cache"), max_documents=None)
    return dataclasses.replace(cfg, data=data), {"documents": spec, "mix": rows[0].summary()}


def _saves(records: list[dict], warmup: int, save_every: int) -> dict:
    """The save fields of a row: the median wait for a save, and the median time of the timed
    steps that ran right after a save started against that of the others."""
    saved = {r["step"] for r in records if "checkpoint_s" in r}
    timed = [r for r in records if r["step"] > warmup]
    after = [r for r in timed if r["step"] - 1 in saved]
    others = [r for r in timed if r["step"] - 1 not in saved]
    return {"save_every": save_every,
            "checkpoint_s": _median([r for r in timed if r["step"] in saved], "checkpoint_s"),
            "step_after_save_s": _median(after, "step_time_s") if save_every else None,
            "step_without_save_s": _median(others, "step_time_s") if save_every else None}


@contextlib.contextmanager
def _environment(name: str, folder: str | None) -> Iterator[None]:
    """Set ``name`` to ``folder`` (made absolute) for the training processes started meanwhile
    (they inherit the environment); nothing when ``folder`` is None."""
    if folder is None:
        yield
        return
    saved = os.environ.get(name)
    os.environ[name] = os.path.abspath(folder)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _profile_fields(folder: Path, step: int) -> dict:
    """Rank 0's profile of step ``step`` as row fields (none if it wrote no summary)."""
    path = folder / f"rank0-step{step}-kernels.json"
    if not path.exists():
        return {}
    summary = json.loads(path.read_text())
    return {"profile_wall_ms": summary["wall_ms"],
            **{f"profile_{cat}_ms": ms for cat, ms in summary["categories_ms"].items()}}


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send this process's and its children's stdout to stderr for the duration."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedding host): Python-level only
        saved = None
    try:
        if saved is not None:
            os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _parent(cfg: RecipeConfig) -> str:
    parent = Path(cfg.train.output_dir)
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent)


def _bench_recipe(cfg: RecipeConfig, output_dir: Path, total_steps: int,
                  save_every: int = 0) -> RecipeConfig:
    """The recipe with the step count, a per-step log (metrics.jsonl only), no validation, a
    scratch output folder and checkpoints only every ``save_every`` steps (none when 0; never a
    final export)."""
    train = dataclasses.replace(cfg.train, max_steps=total_steps, epochs=None, log_every=1,
                                output_dir=str(output_dir), eval_every=0, report_to=("jsonl",))
    data = dataclasses.replace(cfg.data, eval_source=None, eval_fraction=0.0)
    checkpoint = dataclasses.replace(cfg.checkpoint, enabled=save_every > 0, every=save_every,
                                     keep=1, export_final=False)
    return dataclasses.replace(cfg, data=data, train=train, checkpoint=checkpoint)


def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        raise UserError(f"the training run wrote no metrics ({path} is missing)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _row(cfg: RecipeConfig, nproc: int, records: list[dict], warmup: int, layers: int,
         predicted: dict) -> dict:
    timed = [r for r in records if r["step"] > warmup] or records
    measured = max((r.get("peak_memory_bytes") or 0) for r in records)
    host = max((r.get("host_memory_bytes") or 0) for r in records) if cuda_run(records) else None
    calls = records[0].get("attention_forward_calls") if records else None  # the run's 1st step
    per_micro = 2 if cfg.train.checkpointing == "full" else 1
    runs = predicted.get("layer_policies")
    if cfg.train.checkpointing == "auto" and runs:  # each full layer runs attention twice
        parsed = parse_layer_policies(runs)  # and a pair runs its lower layer once more
        per_micro = 1 + (recomputed_layers(parsed) + chained_layers(parsed)) / layers
    cuda = torch.cuda.is_available()
    return {
        "gpus": nproc, "cp": cfg.parallel.cp, "schedule": cfg.parallel.schedule,
        "policy": cfg.train.checkpointing, "layer_policies": runs,
        "fused_norms": cfg.model.fused_norms and cuda,
        "fused_mlp": cfg.model.fused_mlp and cuda, "fused_loss": cfg.model.fused_loss and cuda,
        "grouped_attention": cfg.model.grouped_attention,
        "deferred_norms": cfg.model.deferred_norms,
        "steps": len(timed),
        "tokens_per_s": _median(timed, "tokens_per_s"),
        "step_time_s": _median(timed, "step_time_s"),
        "mfu": _median(timed, "mfu"),
        "peak_gib": measured / _GIB,
        "model_peak_gib": predicted["peak_allocated"] / _GIB,
        "model_total_gib": predicted["total"] / _GIB,
        "peak_vs_model": measured / predicted["peak_allocated"] if cuda else None,
        "host_gib": None if host is None else host / _GIB,
        "model_host_gib": predicted["host_offload"] / _GIB if host is not None else None,
        "attn_fwd_per_step": calls,
        "attention_balance": _median(timed, "attention_balance"),
        "attn_fwd_expected": round(layers * per_micro) * cfg.train.grad_accum,
        "loss_first": records[0]["loss"] if records else None,
        "loss_last": records[-1]["loss"] if records else None,
        "status": "ok",
    }


def cuda_run(records: list[dict]) -> bool:
    """Whether the run logged host memory (GPU runs do)."""
    return any("host_memory_bytes" in r for r in records)


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _expectations(cfg: RecipeConfig, nproc: int) -> tuple[int, dict]:
    """(decoder layers, the memory model's per-GPU prediction for this run)."""
    from lctrain.memory import estimate_recipe, recipe_architecture

    from lctrain.memory.host import available_host_bytes

    arch = recipe_architecture(cfg)
    memory = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
              else 80 << 30)
    host = cfg.train.host_memory or available_host_bytes()  # what an auto run places against
    est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=nproc, gpu_memory=memory,
                          host_memory=host, gpus_per_node=nproc)
    return arch.num_layers, {"peak_allocated": est.details["peak_allocated"],
                             "total": est.per_gpu_bytes["total"],
                             "host_offload": est.details["host_offload"],
                             "layer_policies": est.details.get("layer_policies")}


def _progress_line(row: dict) -> str:
    from lctrain.report.human import percent, significant

    if row.get("status") != "ok":
        return str(row.get("status"))
    text = (f"{significant(row['step_time_s'])} s/step, "
            f"{significant(row['tokens_per_s'])} tokens/s, peak {significant(row['peak_gib'])} GiB")
    return text + (f", MFU {percent(row['mfu'])}" if row.get("mfu") is not None else "")


def _meta(cfg: RecipeConfig, nproc: int | None, warmup: int, steps: int,
          save_every: int) -> dict:
    from lctrain.model.flops import peak_flops

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    peak = peak_flops(device)
    return {
        "machine": environment(), "device": device.type,
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "nproc": nproc, "warmup_steps": warmup, "timed_steps": steps, "save_every": save_every,
        "attention_backend": cfg.parallel.attention_backend,
        "mixed_precision": cfg.train.mixed_precision, "model_dtype": cfg.model.dtype,
        "batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum,
    }
