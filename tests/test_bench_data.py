"""``lctrain bench data``: preparation timed cold and warm in caches of its own, with the
source's records, bytes and tokens counted independently here."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch


def test_bench_data_times_a_cold_and_a_warm_preparation(tmp_path):
    rng = random.Random(torch.initial_seed())
    texts = [" ".join(rng.choice(["red", "green", "blue", "café"]) for _ in range(rng.randint(1, 40)))
             for _ in range(rng.randint(20, 60))]
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "data.json"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "mine")}
    run = subprocess.run([sys.executable, "-m", "lctrain", "bench", "data", "--set",
                          f"data.source={source}", "--set", "data.tokenizer=bytes", "--json",
                          str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["records"] == len(texts) and row["processes"] == 1
    assert row["tokens"] == sum(len(t.encode()) + 2 for t in texts)  # bos, bytes, eos
    assert row["megabytes"] == pytest.approx(source.stat().st_size / 2**20)
    assert 0 < row["warm_s"] < row["cold_s"]
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["cold_s"])
    assert not (tmp_path / "mine").exists()  # caches of its own: the user's are untouched
    assert "Data preparation" in run.stdout and str(source) in run.stdout
