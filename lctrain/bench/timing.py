"""The one timing helper of every lctrain benchmark: medians of forward and backward times, with
CUDA events on a GPU (the host waits once, after the last) and the host clock on a CPU.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Timings:
    """Milliseconds of each timed iteration: ``fwd[i]`` and ``bwd[i]`` (empty without one)."""

    fwd: list[float]
    bwd: list[float]

    @property
    def total(self) -> list[float]:
        """Forward + backward of each iteration."""
        return [a + b for a, b in zip(self.fwd, self.bwd)] if self.bwd else list(self.fwd)

    def summary(self) -> dict:
        """Medians and spread: ``fwd_ms``, ``bwd_ms``, ``total_ms`` and ``total_ms_min/max``."""
        out = {"fwd_ms": statistics.median(self.fwd)}
        if self.bwd:
            out["bwd_ms"] = statistics.median(self.bwd)
        total = self.total
        out.update(total_ms=statistics.median(total), total_ms_min=min(total),
                   total_ms_max=max(total), repeats=len(total))
        return out


def measure(fwd: Callable[[], Any], bwd: Callable[[Any], Any] | None = None, *,
            device: torch.device, repeats: int, warmup: int) -> Timings:
    """Time ``bwd(fwd())`` (or ``fwd()`` alone when ``bwd`` is None) on ``device``: ``warmup``
    untimed iterations, then ``repeats`` (≥ 1) timed ones; returns their milliseconds."""
    for _ in range(warmup):
        state = fwd()
        if bwd is not None:
            bwd(state)
    if device.type != "cuda":
        fw, bw = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state = fwd()
            t1 = time.perf_counter()
            fw.append((t1 - t0) * 1e3)
            if bwd is not None:
                bwd(state)
                bw.append((time.perf_counter() - t1) * 1e3)
        return Timings(fw, bw)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(repeats)]
    for e0, e1, e2 in events:
        e0.record()
        state = fwd()
        e1.record()
        if bwd is not None:
            bwd(state)
        e2.record()
    torch.cuda.synchronize(device)
    fw = [a.elapsed_time(b) for a, b, _ in events]
    bw = [b.elapsed_time(c) for _, b, c in events] if bwd is not None else []
    return Timings(fw, bw)


def repeats_for(estimate_ms: float, repeats: int, min_time_s: float, cap: int = 50) -> int:
    """Timed iterations: at least ``repeats``, more (up to ``cap``) until about ``min_time_s``
    of timing when one iteration takes ``estimate_ms`` (short measurements are noisy)."""
    if not min_time_s or estimate_ms <= 0:
        return repeats
    return int(min(cap, max(repeats, math.ceil(min_time_s * 1e3 / estimate_ms))))
