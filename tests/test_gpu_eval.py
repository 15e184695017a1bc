"""``lctrain eval`` on the machine's GPUs (``pytest -m gpu``; skipped without one), as a user
starts it: one process per GPU over NCCL, cp = the number of GPUs, the automatic attention
backend (our kernels on packed documents), float32.

- ``--task ppl``: the loss of every bucket of positions equals plain transformers' eager loss of
  the same model on the same rows (float32 on the CPU, one document at a time);
- ``--task passkey``: prompts, answers and accuracy for every length and depth, end to end.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from eval_reference import eager_losses, eager_model, save_tiny_model, texts

pytestmark = pytest.mark.gpu


def _eval(*args: str) -> subprocess.CompletedProcess:
    gpus = torch.cuda.device_count()
    run = subprocess.run([sys.executable, "-m", "lctrain", "eval", *args, "--cp", str(gpus),
                          "--set", "train.mixed_precision=no", "--format", "csv"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-1500:]
    return run


def test_eval_ppl_on_every_gpu_matches_transformers_by_bucket(tmp_path):
    from transformers import AutoTokenizer

    from lctrain.config import DataConfig
    from lctrain.data import prepare_data

    rng = random.Random(random.randrange(2**31))
    folder = save_tiny_model(tmp_path / "model", rng.randrange(2**31))
    data = texts(tmp_path / "eval.jsonl", 24, rng, longest=700)
    out = tmp_path / "ppl.json"
    run = _eval(str(folder), "--task", "ppl", "--seq-len", "512", "--bucket", "64", "--data",
                str(data), "--json", str(out))
    assert run.stdout.startswith("bucket,")
    result = json.loads(out.read_text())
    got = {r["bucket"]: r for r in result["rows"]}
    rows = prepare_data(DataConfig(source=str(data), seq_len=512, tokenizer=None),
                        AutoTokenizer.from_pretrained(folder))
    model = eager_model(folder)
    per_bucket: dict[int, list[float]] = {}
    for r in range(len(rows)):
        for position, loss in eager_losses(model, rows[r]):
            per_bucket.setdefault(position // 64, []).append(loss)
    assert len(got) == 9  # 8 buckets and "all"
    for b, row in enumerate(r for name, r in got.items() if name != "all"):
        losses = per_bucket.get(b, [])
        assert row["tokens"] == len(losses)
        if losses:  # float32 matrix products on the GPU against the CPU's
            assert row["loss"] == pytest.approx(sum(losses) / len(losses), rel=2e-3)
    every = [x for losses in per_bucket.values() for x in losses]
    assert got["all"]["tokens"] == len(every) > 0
    assert got["all"]["loss"] == pytest.approx(sum(every) / len(every), rel=1e-3)


def test_eval_passkey_on_every_gpu_end_to_end(tmp_path):
    folder = save_tiny_model(tmp_path / "model", random.randrange(2**31))
    out = tmp_path / "pk.json"
    _eval(str(folder), "--task", "passkey", "--lengths", "512,768", "--depths", "0,0.5,1",
          "--trials", "2", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq_len"], r["depth"]) for r in rows] == [
        (n, d) for n in (512, 768) for d in (0.0, 0.5, 1.0)]
    for row in rows:
        assert len(row["samples"]) == 2
        assert row["accuracy"] == sum(s["correct"] for s in row["samples"]) / 2
