"""``lctrain bench step``: time whole training steps of a recipe through the real runner.

Each configuration runs through `lctrain.train.runner.finetune` into a scratch folder; its
metrics.jsonl gives one row of medians over the timed steps (tokens/s, MFU, peak memory beside the
memory model's, ...), or a status that says why it could not run."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from lctrain.bench import gpu_power
from lctrain.bench.data import caches_in, environment_folders
from lctrain.bench.documents import Documents, training_rows
from lctrain.bench.result import BenchResult
from lctrain.config import RecipeConfig, load_recipe
from lctrain.config.layers import LayerPlan
from lctrain.data import epoch_order
from lctrain.model import load_tokenizer
from lctrain.model.flops import peak_flops
from lctrain.errors import ConfigError, UserError
from lctrain.report.human import percent, significant
from lctrain.report.runs import median
from lctrain.report.versions import environment
from lctrain.train.memory_trace import ENV as MEMORY_TRACE
from lctrain.train.step_profile import ENV as STEP_PROFILE

_GIB = float(1 << 30)


def configurations(recipe: str | None, overrides: list[str], seq_lens: list[int] | None,
                   variants: list[str] | None = None) -> list[tuple[str, RecipeConfig]]:
    """``(label, config)``: the recipe with ``overrides`` at every sequence length (None: the
    recipe's own) × every variant (space-separated ``key=value`` overrides, also the label)."""
    return [(group, load_recipe(recipe, [*overrides, *_settings(group)], seq_len=seq_len))
            for seq_len in seq_lens or [None] for group in variants or [""]]


def _settings(variant: str) -> list[str]:
    """The ``key=value`` items of one ``--variant`` (ConfigError naming it when malformed)."""
    try:
        items = shlex.split(variant)
    except ValueError as error:  # an unclosed quote
        raise ConfigError(f"--variant {variant!r} cannot be split ({error}); close its quotes") from None
    for item in items:
        if not item.partition("=")[0].strip() or "=" not in item:
            raise ConfigError(f"--variant {variant!r}: {item!r} must look like key=value; a variant "
                              "is space-separated settings such as 'train.lr=1e-4 parallel.cp=1'")
    return items


def run(configs: RecipeConfig | list[tuple[str, RecipeConfig]], steps: int,
        nproc: int | None = None, *, warmup: int = 1, save_every: int = 0,
        documents: str | None = None, memory_trace: str | None = None,
        profile: str | None = None, progress: Callable[[str], None] | None = None
        ) -> BenchResult:
    """Run ``warmup`` untimed and ``steps`` timed steps of every configuration (one recipe, or
    `configurations`); one row each. A checkpoint every ``save_every`` steps (0: never);
    ``documents`` trains on random ids packed as that mix; ``memory_trace`` and ``profile`` are
    folders for each configuration's last step."""
    if steps < 1 or warmup < 0 or save_every < 0:
        raise UserError(f"bench step needs at least 1 timed step (got {steps}), a warm-up of 0 or "
                        f"more (got {warmup}) and a save interval of 0 or more (got {save_every})")
    if isinstance(configs, RecipeConfig):
        configs = [("", configs)]
    from lctrain.launch.launcher import default_nproc

    say = progress or (lambda line: None)
    rows = []
    for index, (label, cfg) in enumerate(configs, 1):
        n = nproc if nproc is not None else default_nproc(cfg)
        head = f"configuration {index}/{len(configs)}: {cfg.data.seq_len} tokens" + (
            f", {label}" if label else "")
        say(f"{head}: {warmup} warm-up + {steps} timed steps on {n} processes")
        row = {"variant": label, "seq_len": cfg.data.seq_len}
        try:
            trace = None if memory_trace is None else os.path.join(memory_trace, str(index))
            kernels = None if profile is None else os.path.join(profile, str(index))
            with environment_folders(**{MEMORY_TRACE: trace, STEP_PROFILE: kernels}):
                row.update(_one(cfg, n, steps, warmup, save_every, documents))
            summary = kernels and Path(kernels, f"rank0-step{warmup + steps}-kernels.json")
            if summary and summary.exists():  # rank 0's profile of the last step
                profiled = json.loads(summary.read_text())
                row.update(profile_wall_ms=profiled["wall_ms"], **{
                    f"profile_{cat}_ms": ms for cat, ms in profiled["categories_ms"].items()})
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


def _one(cfg: RecipeConfig, nproc: int, steps: int, warmup: int, save_every: int,
         documents: str | None = None) -> dict:
    """One configuration's row fields (raises UserError when it cannot run)."""
    from lctrain.export.write import remove_empty
    from lctrain.launch.launcher import keep_workers_log
    from lctrain.train.runner import finetune

    drawn = None if documents is None else documents_steps(cfg, documents, nproc, steps, warmup)
    share = 1.0 if drawn is None else attended(cfg, nproc, drawn[1])
    layers, predicted = _expectations(cfg, nproc, share)  # before the run: a bad model fails fast
    parent = Path(cfg.train.output_dir).absolute()
    made = [p for p in (parent, *parent.parents) if not p.exists()]  # removed at the end if empty
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".bench-step-", dir=parent))
    data = None if documents is None else Path(tempfile.mkdtemp(prefix=".bench-data-", dir=parent))
    mix = {}
    try:
        if data is not None:
            cfg, mix = _with_documents(cfg, data, documents, *drawn)
            mix["attended"] = share
        with _stdout_to_stderr(), caches_in(data), \
                gpu_power.sampled(nproc) as samples:
            code = finetune(_bench_recipe(cfg, scratch, warmup + steps, save_every),
                            nproc=nproc, own_process=True)
        if code != 0:
            kept = keep_workers_log(scratch)
            where = "the output above" if kept is None else f"its workers' log, kept at {kept},"
            raise UserError(f"the benchmarked training run failed with exit code {code}; "
                            f"{where} says why")
        metrics = scratch / "metrics.jsonl"
        if not metrics.exists():
            raise UserError(f"the training run wrote no metrics ({metrics} is missing)")
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if data is not None:
            shutil.rmtree(data, ignore_errors=True)
        remove_empty(made)
    timed = [r for r in records if r["step"] > warmup] or records  # the GPUs over timed steps
    power = gpu_power.during(samples, timed[0]["time"] - timed[0]["step_time_s"],
                             timed[-1]["time"]) if timed else {}
    return (_row(cfg, nproc, records, timed, warmup, layers, predicted) | mix | power
            | _saves(records, timed, save_every))


def documents_steps(cfg: RecipeConfig, spec: str, nproc: int, steps: int,
                    warmup: int) -> tuple[list[Documents], list[list[Documents]]]:
    """The rows that ``bench step --documents spec`` draws (one for each warm-up and timed
    micro-batch), and each timed step's rows in the order the loader reads them."""
    per_step = max(1, nproc // cfg.parallel.cp) * cfg.train.batch_size * cfg.train.grad_accum
    rows = training_rows(spec, cfg.data.seq_len, (warmup + steps) * per_step)
    work = np.array([row.pairs for row in rows]) if cfg.data.document_mask else None
    order = epoch_order(len(rows), cfg.train.seed, 0, work, per_step)
    return rows, [[rows[r] for r in order[k * per_step:(k + 1) * per_step]]
                  for k in range(warmup, warmup + steps)]


def attended(cfg: RecipeConfig, nproc: int, steps: list[list[Documents]]) -> float:
    """`Setup.attended` of ``steps``: the median over steps of the mean over micro-batches of the
    busiest dp rank's Σ n² / S² (1.0 without the document mask)."""
    if not cfg.data.document_mask:
        return 1.0
    dp, area = max(1, nproc // cfg.parallel.cp), cfg.data.seq_len ** 2
    return float(np.median([np.mean([max(r.pairs for r in rows[i:i + dp])
                                     for i in range(0, len(rows), dp)]) for rows in steps])) / area


def _with_documents(cfg: RecipeConfig, folder: Path, spec: str, rows: list[Documents],
                    timed: list[list[Documents]]) -> tuple[RecipeConfig, dict]:
    """The recipe reading ``rows`` (`documents_steps`) of random ids from a tokenized JSONL file
    in ``folder``, and the fields naming ``spec`` and the mix of the ``timed`` steps' rows."""
    vocab = min(len(load_tokenizer(cfg)), 32000)
    rng = np.random.default_rng(0)
    with (folder / "documents.jsonl").open("w") as f:
        for row in rows:
            for n in row.lengths:
                f.write(json.dumps({"input_ids": rng.integers(3, vocab, n).tolist()}) + "\n")
    data = dataclasses.replace(cfg.data, source=str(folder / "documents.jsonl"),
                               format="tokenized", long_samples="split", max_documents=None)
    return dataclasses.replace(cfg, data=data), {
        "documents": spec, "mix": Documents.summary_of([row for step in timed for row in step])}


def _saves(records: list[dict], timed: list[dict], save_every: int) -> dict:
    """The save fields of a row: the median wait for a save, and the median time of the
    ``timed`` steps right after a save started and of the others."""
    saved = {r["step"] for r in records if "checkpoint_s" in r}
    after = [r for r in timed if r["step"] - 1 in saved]
    others = [r for r in timed if r["step"] - 1 not in saved]
    return {"save_every": save_every,
            "checkpoint_s": median(timed, "checkpoint_s"),
            "step_after_save_s": median(after, "step_time_s") if save_every else None,
            "step_without_save_s": median(others, "step_time_s") if save_every else None}


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


def _bench_recipe(cfg: RecipeConfig, output_dir: Path, total_steps: int,
                  save_every: int = 0) -> RecipeConfig:
    """The recipe for a timed run: ``total_steps``, metrics.jsonl only, no validation, the
    scratch ``output_dir``, checkpoints every ``save_every`` steps (0: none), no export."""
    train = dataclasses.replace(cfg.train, max_steps=total_steps, epochs=None,
                                output_dir=str(output_dir), eval_every=0, report_to=("jsonl",))
    data = dataclasses.replace(cfg.data, eval_source=None)
    checkpoint = dataclasses.replace(cfg.checkpoint, every=save_every, keep=int(save_every > 0),
                                     export_final=False)
    return dataclasses.replace(cfg, data=data, train=train, checkpoint=checkpoint)


def _row(cfg: RecipeConfig, nproc: int, records: list[dict], timed: list[dict], warmup: int,
         layers: int, predicted: dict) -> dict:
    measured = max((r.get("peak_memory_bytes") or 0) for r in records)
    model = predicted["first_step_peak" if len(records) == 1 else "peak_allocated"]
    gpu_run = any("host_memory_bytes" in r for r in records)  # GPU runs log host memory
    host = max((r.get("host_memory_bytes") or 0) for r in records) if gpu_run else None
    calls = records[0].get("attention_forward_calls") if records else None  # the run's 1st step
    runs = predicted["checkpointing"]  # each full layer runs attention twice
    per_micro = 1 + LayerPlan.parse(runs).count("full", layers) / layers
    cuda = torch.cuda.is_available()
    return {
        "gpus": nproc, "cp": cfg.parallel.cp, "schedule": cfg.parallel.schedule,
        "policy": cfg.train.checkpointing, "checkpointing": runs,
        "offload": predicted["offload"], "fused_kernels": cfg.model.fused_kernels,
        "steps": len(timed),
        "tokens_per_s": median(timed, "tokens_per_s"),
        "step_time_s": median(timed, "step_time_s"),
        "step_times_s": [r.get("step_time_s") for r in timed],  # the spread behind the median
        "alloc_retries": _timed_retries(records, warmup),
        "mfu": median(timed, "mfu"),
        "peak_gib": measured / _GIB,
        "reserved_gib": (max(r["peak_reserved_bytes"] for r in records) / _GIB
                         if records and "peak_reserved_bytes" in records[-1] else None),
        "model_peak_gib": model / _GIB,
        "model_step_s": predicted["step_seconds"] if cuda else None,  # a GPU's time
        "model_total_gib": predicted["total"] / _GIB,
        "peak_vs_model": measured / model if cuda else None,
        "host_gib": None if host is None else host / _GIB,
        "model_host_gib": predicted["host_offload"] / _GIB if host is not None else None,
        "attn_fwd_per_step": calls,
        "attention_balance": median(timed, "attention_balance"),
        "attn_fwd_expected": round(layers * per_micro) * cfg.train.grad_accum,
        "loss_first": records[0]["loss"] if records else None,
        "loss_last": records[-1]["loss"] if records else None,
        "status": "ok",
    }


def _timed_retries(records: list[dict], warmup: int) -> int | None:
    """The caching allocator's retries after the ``warmup`` steps (None off a GPU)."""
    if not records or "alloc_retries" not in records[-1]:
        return None
    before = records[warmup - 1]["alloc_retries"] if 0 < warmup < len(records) else 0
    return records[-1]["alloc_retries"] - before


def _expectations(cfg: RecipeConfig, nproc: int, share: float) -> tuple[int, dict]:
    """(decoder layers, the memory model's per-GPU prediction for this run, its step time for
    rows that attend ``share`` of one document)."""
    from lctrain.memory import estimate_recipe, recipe_architecture
    from lctrain.memory.host import available_host_bytes
    from lctrain.parallel.mesh import check_parallel_sizes

    check_parallel_sizes(nproc, cfg.parallel.cp)  # said of processes, before the GPU model
    arch = recipe_architecture(cfg)
    memory = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
              else 80 << 30)
    host = cfg.train.host_memory or available_host_bytes()  # what an auto run places against
    est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=nproc, gpu_memory=memory,
                          host_memory=host, gpus_per_node=nproc, attended=share)
    return arch.num_layers, {**est.details, "total": est.per_gpu_bytes["total"]}


def _progress_line(row: dict) -> str:
    if row.get("status") != "ok":
        return str(row.get("status"))
    text = (f"{significant(row['step_time_s'])} s/step, "
            f"{significant(row['tokens_per_s'])} tokens/s, peak {significant(row['peak_gib'])} GiB")
    return text + (f", MFU {percent(row['mfu'])}" if row.get("mfu") is not None else "")


def _meta(cfg: RecipeConfig, nproc: int | None, warmup: int, steps: int, save_every: int) -> dict:
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
