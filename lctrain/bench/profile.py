"""Where the time of a measured iteration goes: ``--profile DIR`` of ``lctrain bench``.

After a configuration has been timed, a few more iterations run under ``torch.profiler``; the
timeline is written as a chrome trace (open it in Perfetto or chrome://tracing) and the device
time of every kernel is summed by category:

* attention — the attention kernels (cuDNN, flash, lctrain's Triton kernels);
* communication — NCCL (or gloo) transfers;
* bookkeeping — merges, sums, casts, copies and fills around them;
* other — everything else.

The wall time per iteration is reported beside it, so the share no kernel covers (launch gaps,
waits for a peer) shows too. On a CPU the categories hold the operators' own CPU time.
"""
from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

from lctrain.train.step_profile import category as step_category, own_times

CATEGORIES = (  # first match wins; names are lower-cased kernel or operator names
    ("attention", ("fmha", "cudnn", "flash", "attn_fwd", "attn_bwd", "sdpa", "attention")),
    ("communication", ("nccl", "c10d", "gloo", "send", "recv")),
    ("bookkeeping", ("elementwise", "copy", "merge", "combine", "fill", "cat", "reduce",
                     "vectorized", "unrolled", "index", "add", "mul", "to_copy", "sum")),
)
ITERATIONS = 3


def category(name: str) -> str:
    """The category of a kernel or operator name (see the module docstring)."""
    return step_category(name, CATEGORIES)


def profile(fwd: Callable[[], Any], bwd: Callable[[Any], Any] | None, device: torch.device,
            trace: str | Path, sync: Callable[[], None] | None = None) -> dict:
    """Run ``ITERATIONS`` iterations of ``bwd(fwd())`` under the profiler.

    Args:
        fwd, bwd: the iteration, as for `lctrain.bench.timing.measure`.
        device: where it runs.
        trace: the chrome trace file to write.
        sync: waits for every rank (distributed runs), called before and after the
            iterations; default: wait for this device only.

    Returns:
        Flat row fields: ``profile_wall_ms`` and ``profile_<category>_ms`` per iteration, and
        ``trace`` (the file written).
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
        by_category[category(name)] += ms / ITERATIONS
    row = {"profile_wall_ms": wall_ms, "trace": str(path)}
    for cat in ("attention", "communication", "bookkeeping", "other"):
        row[f"profile_{cat}_ms"] = by_category.get(cat, 0.0)
    return row
