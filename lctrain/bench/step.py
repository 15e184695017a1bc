"""``lctrain bench step``: time whole training steps of a recipe through the real runner.

The recipe runs unchanged through `lctrain.train.runner.finetune` (same model, data, parallel
layout, checkpointing policy and loop as ``lctrain finetune``) for ``warmup + steps`` optimizer
steps into a scratch output folder; the runner's ``metrics.jsonl`` is read back and the first
``warmup`` steps (allocator growth, autotuning) are dropped. Reported, median over the timed
steps:

- tokens/s of the whole job, and step time;
- MFU as the runner logs it (``lctrain.train.metrics``): 6·N per token plus the attention FLOPs
  of the documents actually trained on (7·Σ n²·H·D·L for causal documents of n tokens), over
  GPUs × the GPU's dense bf16 peak (989 TFLOP/s for H100 and H200); recomputation is not
  counted as useful work;
- peak memory, the largest of any rank (the CUDA allocator's peak; on a CPU the process's peak
  RSS) beside the memory model's prediction for the same recipe
  (`lctrain.memory.estimate_recipe`: ``details.peak_allocated``, the figure comparable with
  ``torch.cuda.max_memory_allocated``);
- attention forwards per optimizer step: the runner's ``attention_forward_calls`` (counted by
  `lctrain.parallel.checkpointing.AttentionCounter` on the run's first step, on every rank);
  beside the expected L (none, remat, remat-offload) or 2·L (full) per micro-step.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from lctrain.bench.result import BenchResult
from lctrain.config import RecipeConfig
from lctrain.errors import UserError

_GIB = float(1 << 30)


def run(cfg: RecipeConfig, steps: int, nproc: int | None = None, *, warmup: int = 1) -> BenchResult:
    """Run ``warmup + steps`` training steps of ``cfg`` and report them.

    Args:
        cfg: the resolved recipe (its output_dir is only used to hold a scratch folder).
        steps: optimizer steps to time (≥ 1).
        nproc: processes (default as ``lctrain finetune``: all GPUs, or dp × cp on a CPU).
        warmup: untimed steps first.

    Returns:
        A BenchResult with one row.

    Raises:
        UserError: steps < 1, or the training run failed (a user error, or a worker that died:
            the launcher has already printed where its log is, a traceback would add nothing).
    """
    from lctrain.train.runner import default_nproc, finetune

    if steps < 1 or warmup < 0:
        raise UserError(f"bench step needs at least 1 timed step (got {steps}) and a warm-up "
                        f"of 0 or more (got {warmup})")
    n = nproc if nproc is not None else default_nproc(cfg)
    layers, predicted = _expectations(cfg, n)  # before the run: a bad model fails fast
    scratch = Path(tempfile.mkdtemp(prefix=".bench-step-", dir=_parent(cfg)))
    try:
        bench_cfg = _bench_recipe(cfg, scratch, warmup + steps)
        code = finetune(bench_cfg, nproc=n)
        if code != 0:
            raise UserError(f"the benchmarked training run failed with exit code {code}; the "
                            f"workers' log named above says why")
        records = _read_metrics(scratch / "metrics.jsonl")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    row = _row(cfg, n, records, warmup, layers, predicted)
    return BenchResult(title="training step", rows=[row], meta=_meta(cfg, n, warmup, steps),
                       columns=list(row))


def _parent(cfg: RecipeConfig) -> str:
    parent = Path(cfg.train.output_dir)
    parent.mkdir(parents=True, exist_ok=True)
    return str(parent)


def _bench_recipe(cfg: RecipeConfig, output_dir: Path, total_steps: int) -> RecipeConfig:
    """The recipe with the step count, a per-step log and a scratch output folder."""
    train = dataclasses.replace(cfg.train, max_steps=total_steps, epochs=None, log_every=1,
                                output_dir=str(output_dir))
    checkpoint = dataclasses.replace(cfg.checkpoint, enabled=False)
    return dataclasses.replace(cfg, train=train, checkpoint=checkpoint)


def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        raise RuntimeError(f"the training run wrote no metrics ({path} is missing)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _row(cfg: RecipeConfig, nproc: int, records: list[dict], warmup: int, layers: int,
         predicted: dict) -> dict:
    timed = [r for r in records if r["step"] > warmup] or records
    measured = max((r.get("peak_memory_bytes") or 0) for r in records)
    calls = records[0].get("attention_forward_calls") if records else None  # the run's 1st step
    per_micro = 2 if cfg.train.checkpointing == "full" else 1
    cuda = torch.cuda.is_available()
    return {
        "seq_len": cfg.data.seq_len, "gpus": nproc, "cp": cfg.parallel.cp,
        "policy": cfg.train.checkpointing, "steps": len(timed),
        "tokens_per_s": _median(timed, "tokens_per_s"),
        "step_time_s": _median(timed, "step_time_s"),
        "mfu": _median(timed, "mfu"),
        "peak_gib": measured / _GIB,
        "model_peak_gib": predicted["peak_allocated"] / _GIB,
        "model_total_gib": predicted["total"] / _GIB,
        "peak_vs_model": measured / predicted["peak_allocated"] if cuda else None,
        "attn_fwd_per_step": calls,
        "attn_fwd_expected": layers * per_micro * cfg.train.grad_accum,
        "loss_first": records[0]["loss"] if records else None,
        "loss_last": records[-1]["loss"] if records else None,
    }


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _expectations(cfg: RecipeConfig, nproc: int) -> tuple[int, dict]:
    """(decoder layers, the memory model's per-GPU prediction for this run)."""
    from lctrain.memory import estimate_recipe, recipe_architecture

    arch = recipe_architecture(cfg)
    memory = (torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available()
              else 80 << 30)
    est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=nproc, gpu_memory=memory)
    return arch.num_layers, {"peak_allocated": est.details["peak_allocated"],
                             "total": est.per_gpu_bytes["total"]}


def _meta(cfg: RecipeConfig, nproc: int, warmup: int, steps: int) -> dict:
    import transformers

    from lctrain.train.metrics import peak_flops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    peak = peak_flops(device)
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "nproc": nproc, "warmup_steps": warmup, "timed_steps": steps,
        "schedule": cfg.parallel.schedule, "attention_backend": cfg.parallel.attention_backend,
        "mixed_precision": cfg.train.mixed_precision, "model_dtype": cfg.model.dtype,
        "batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum,
    }
