"""Where the time of a measured iteration goes: ``--profile DIR`` of ``lctrain bench``: a chrome
trace, and the device time of the kernels (a CPU's operators) by category beside the wall time.
"""
from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from lctrain.train.step_profile import category, own_times

CATEGORIES = (  # first match wins; names are lower-cased kernel or operator names
    ("attention", ("fmha", "cudnn", "flash", "attn_fwd", "attn_bwd", "sdpa", "attention")),
    ("communication", ("nccl", "c10d", "gloo", "send", "recv")),
    ("bookkeeping", ("elementwise", "copy", "merge", "combine", "fill", "cat", "reduce",
                     "vectorized", "unrolled", "index", "add", "mul", "to_copy", "sum")),
)
ITERATIONS = 3


def profile(fwd: Callable[[], Any], bwd: Callable[[Any], Any] | None, device: torch.device,
            trace: str | Path, sync: Callable[[], None] | None = None) -> dict:
    """Run ``ITERATIONS`` iterations of ``bwd(fwd())`` (as for `lctrain.bench.timing.measure`)
    under the profiler, writing a chrome trace to ``trace``; ``sync`` also waits for every rank.
    Returns row fields: ``profile_wall_ms``, ``profile_<category>_ms`` per iteration, ``trace``.
    """
    def wait():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if sync is not None:
            sync()

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    wait()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(ITERATIONS):
            state = fwd()
            if bwd is not None:
                bwd(state)
        wait()
        wall_ms = (time.perf_counter() - start) * 1e3 / ITERATIONS
    path = Path(trace)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    by_category: dict[str, float] = defaultdict(float)
    for name, (ms, _) in own_times(prof, device.type == "cuda").items():
        by_category[category(name, CATEGORIES)] += ms / ITERATIONS
    row = {"profile_wall_ms": wall_ms, "trace": str(path)}
    for cat in ("attention", "communication", "bookkeeping", "other"):
        row[f"profile_{cat}_ms"] = by_category.get(cat, 0.0)
    return row
