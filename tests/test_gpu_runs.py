"""Whole training runs on the machine's GPUs (``pytest -m gpu``; skipped without one).

The embedded tiny recipe on every GPU over NCCL, cp = the number of GPUs, as a user starts it
(``python -m lctrain finetune``, which launches one process per GPU):

* float32 with FSDP2 on and off, and on with its CPU offload (parameters, gradients and AdamW
  states on the host): the same computation, so the same losses.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _losses(out: Path, *sets: str, steps: int = 8) -> list[float]:
    gpus = torch.cuda.device_count()
    args = [sys.executable, "-m", "lctrain", "finetune", "--max-steps", str(steps),
            "--output-dir", str(out), "--set", f"parallel.cp={gpus}"]
    for item in sets:
        args += ["--set", item]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-1500:]
    assert "lctrain " in run.stdout and "first steps:" in run.stdout  # versions, one-time costs
    assert (out / "environment.json").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    retries = [r["alloc_retries"] for r in records]  # the allocator's, so far: never fewer
    assert retries == sorted(retries) and all(isinstance(n, int) and n >= 0 for n in retries)
    reserved = [r["peak_reserved_bytes"] for r in records]  # never under what it held
    assert reserved == sorted(reserved)
    assert all(r["peak_reserved_bytes"] >= r["peak_memory_bytes"] > 0 for r in records)
    return [r["loss"] for r in records]


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def test_fsdp_on_off_and_offloaded_train_alike_on_every_gpu(tmp_path):
    off = _losses(tmp_path / "off", "parallel.fsdp=off", "train.mixed_precision=no")
    on = _losses(tmp_path / "on", "parallel.fsdp=on", "train.mixed_precision=no")
    host = _losses(tmp_path / "host", "parallel.fsdp=on", "train.mixed_precision=no",
                   "train.offload=state")
    assert _max_rel(off, on) < 1e-3 and on[-1] < on[0]
    assert _max_rel(off, host) < 1e-3

