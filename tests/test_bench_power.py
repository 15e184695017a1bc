"""GPU clocks and power beside bench step's rows: nvidia-smi's CSV read back, medians over the
timed window against plain Python, and the sampler's process started and stopped."""
from __future__ import annotations

import random
import statistics
import time
from datetime import datetime

import torch

from lctrain.bench.gpu_power import FIELDS, during, parse, sampled


def test_nvidia_smi_lines_are_read_and_unreadable_ones_left():
    text = ("2026/11/28 00:54:31.530, 1575, 690.12, 700.00\n"
            "2026/11/28 00:54:31.538, 1980, [N/A], 700.00\n\n"
            "2026/11/28 00:54:31.795, 1440, 689.5, 700.00\n"
            "2026/11/28 00:54:32.0")  # cut off when the sampler stopped
    rows = parse(text)
    first = datetime(2026, 11, 28, 0, 54, 31, 530000).timestamp()
    assert rows == [(first, 1.575, 690.12, 700.0), (first + 0.265, 1.44, 689.5, 700.0)]


def test_medians_cover_only_the_timed_window():
    rng = random.Random(torch.initial_seed())
    samples = [(t + rng.random() / 2, rng.uniform(0.345, 1.98), rng.uniform(80, 700), 700.0)
               for t in range(100)]
    start, end = rng.uniform(10, 40), rng.uniform(60, 90)
    inside = [s for s in samples if start <= s[0] <= end]
    got = during(samples, start, end)
    assert set(got) == set(FIELDS)
    for i, name in enumerate(FIELDS, start=1):
        assert got[name] == statistics.median(s[i] for s in inside)
    assert during(samples, 200.0, 300.0) == dict.fromkeys(FIELDS)


def test_the_sampler_runs_nvidia_smi_on_the_runs_gpus_until_the_block_ends(tmp_path,
                                                                             monkeypatch):
    """A stand-in nvidia-smi (none on a CPU machine) that prints a sample every 50 ms."""
    smi, called = tmp_path / "nvidia-smi", tmp_path / "args"
    smi.write_text(f'#!/bin/sh\necho "$@" > {called}\n'
                   'while true; do echo "$(date "+%Y/%m/%d %H:%M:%S.%N" | cut -c1-23), 1500, '
                   '690, 700"; sleep 0.05; done\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with sampled(2, every_ms=50) as samples:
        start = time.time()
        time.sleep(0.6)
        assert samples == []  # filled when the block ends
    end = time.time()
    assert "--id=0,1" in called.read_text() and "--loop-ms=50" in called.read_text()
    assert len(samples) >= 3 and all(start - 1 <= s[0] <= end + 1 for s in samples)
    assert during(samples, start - 1, end + 1) == {"sm_clock_ghz": 1.5, "power_w": 690.0,
                                                   "power_limit_w": 700.0}
    for visible, gpus, ids in (("3,5,6", 2, "3,5"), (None, 1, "0"), (None, 2, "0,1")):
        if visible is None:  # no CUDA_VISIBLE_DEVICES: the first GPUs
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        with sampled(gpus, every_ms=50):
            time.sleep(0.2)
        assert f"--id={ids} " in called.read_text(), (visible, gpus)
    monkeypatch.setenv("PATH", "/nowhere")
    with sampled(1) as none:
        pass
    assert none == []
