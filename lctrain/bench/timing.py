"""The one timing helper of every lctrain benchmark: medians of forward and backward times, with
CUDA events on a GPU (the host waits once, after the last) and the host clock on a CPU; and where
the time of a measured iteration goes (``--profile DIR``): a chrome trace, and the device time of
the kernels (a CPU's operators) by category beside the wall time."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lctrain.train.step_profile import category, own_times, profiler


@dataclass(frozen=True)
class Timings:
    """Milliseconds of each timed iteration: ``fwd[i]`` and ``bwd[i]``."""

    fwd: list[float]
    bwd: list[float]

    @property
    def total(self) -> list[float]:
        """Forward + backward of each iteration."""
        return [a + b for a, b in zip(self.fwd, self.bwd)]

    def summary(self) -> dict:
        """Medians ``fwd_ms``, ``bwd_ms``, ``total_ms``, each one's ``_min`` and ``_max``, and
        ``repeats``."""
        row = {}
        for name, ms in (("fwd", self.fwd), ("bwd", self.bwd), ("total", self.total)):
            row.update({f"{name}_ms": statistics.median(ms), f"{name}_ms_min": min(ms),
                        f"{name}_ms_max": max(ms)})
        return {**row, "repeats": len(self.fwd)}


def measure(fwd: Callable[[], Any], bwd: Callable[[Any], Any], *, device: torch.device,
            repeats: int, warmup: int) -> Timings:
    """Time ``bwd(fwd())`` on ``device``: ``warmup`` untimed iterations, then ``repeats`` (≥ 1)
    timed ones; returns their milliseconds."""
    for _ in range(warmup):
        bwd(fwd())
    if device.type != "cuda":
        fw, bw = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state = fwd()
            t1 = time.perf_counter()
            fw.append((t1 - t0) * 1e3)
            bwd(state)
            bw.append((time.perf_counter() - t1) * 1e3)
        return Timings(fw, bw)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(repeats)]
    for e0, e1, e2 in events:
        e0.record()
        state = fwd()
        e1.record()
        bwd(state)
        e2.record()
    torch.cuda.synchronize(device)
    return Timings([a.elapsed_time(b) for a, b, _ in events],
                   [b.elapsed_time(c) for _, b, c in events])


def repeats_for(estimate_ms: float, repeats: int, min_time_s: float, cap: int = 50) -> int:
    """Timed iterations: at least ``repeats``, more (up to ``cap``) until about ``min_time_s``
    of timing when one iteration takes ``estimate_ms`` (short measurements are noisy)."""
    if not min_time_s or estimate_ms <= 0:
        return repeats
    return int(min(cap, max(repeats, math.ceil(min_time_s * 1e3 / estimate_ms))))


CATEGORIES = (  # first match wins; names are lower-cased kernel or operator names
    ("attention", ("fmha", "cudnn", "flash", "attn_fwd", "attn_bwd", "sdpa", "attention")),
    ("communication", ("nccl", "c10d", "gloo", "send", "recv")),
    ("bookkeeping", ("elementwise", "copy", "merge", "combine", "fill", "cat", "reduce",
                     "vectorized", "unrolled", "index", "add", "mul", "to_copy", "sum")),
)
ITERATIONS = 3


def profile(fwd: Callable[[], Any], bwd: Callable[[Any], Any], device: torch.device,
            trace: str | Path, sync: Callable[[], None] | None = None) -> dict:
    """Run ``ITERATIONS`` iterations of ``bwd(fwd())`` (as for `measure`) under the profiler,
    writing a chrome trace to ``trace``; ``sync`` also waits for every rank. Returns row fields:
    ``profile_wall_ms``, ``profile_<category>_ms`` per iteration, ``trace``."""
    def wait():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if sync is not None:
            sync()

    wait()
    with profiler(device) as prof:
        start = time.perf_counter()
        for _ in range(ITERATIONS):
            bwd(fwd())
        wait()
        wall_ms = (time.perf_counter() - start) * 1e3 / ITERATIONS
    path = Path(trace)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    row = {"profile_wall_ms": wall_ms, "trace": str(path),
           **{f"profile_{cat}_ms": 0.0 for cat, _ in (*CATEGORIES, ("other", ()))}}
    for name, (ms, _) in own_times(prof, device.type == "cuda").items():
        row[f"profile_{category(name, CATEGORIES)}_ms"] += ms / ITERATIONS
    return row
