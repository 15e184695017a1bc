"""Where a step's time goes (``lctrain bench step --profile DIR``): with
``LCTRAIN_STEP_PROFILE=DIR`` every rank profiles the last step into a chrome trace and a kernel
summary by `CATEGORIES`."""
from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

ENV = "LCTRAIN_STEP_PROFILE"
CATEGORIES = (  # first match wins; lower-cased kernel (GPU) or operator (CPU) names
    ("attention", ("fmha", "sdpa", "flash", "attn_fwd", "attn_bwd", "attention")),
    ("communication", ("nccl", "c10d", "gloo")),
    ("copies", ("memcpy", "memset")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "aten::mm",
                "aten::addmm", "aten::bmm")),
)
CATEGORY_NAMES = (*(name for name, _ in CATEGORIES), "other")
TOP = 25


def category(name: str, categories=CATEGORIES) -> str:
    """The first of ``categories`` (name, keys) with a key in the lower-cased name, or "other"."""
    low = name.lower()
    return next((cat for cat, keys in categories if any(k in low for k in keys)), "other")


def profile_folder() -> Path | None:
    """The folder the environment asks the step profiles for (None: no profiling)."""
    folder = os.environ.get(ENV)
    return Path(folder) if folder else None


@contextlib.contextmanager
def profiled_step(folder: Path | None, device: torch.device, rank: int, step: int):
    """Profile the step run inside into ``folder`` (nothing when it is None). Yields a dict
    whose ``outside_s`` is, on exit, the seconds spent around the step (starting and stopping
    the profiler, writing its files), which the step's time leaves out."""
    spent = {"outside_s": 0.0}
    if folder is None:
        yield spent
        return
    entered = time.perf_counter()
    with profiler(device) as prof:
        start = time.perf_counter()
        yield spent
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"rank{rank}-step{step}"
    prof.export_chrome_trace(f"{stem}.json")
    summary = summarize(own_times(prof, device.type == "cuda"), wall * 1e3)
    Path(f"{stem}-kernels.json").write_text(json.dumps(summary, indent=1) + "\n")
    Path(f"{stem}-kernels.txt").write_text(report(summary))
    spent["outside_s"] = time.perf_counter() - entered - wall


def profiler(device: torch.device):
    """torch's profiler of the CPU and, on a GPU, its kernels, entered with the GPU idle."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    return torch.profiler.profile(activities=activities)


def own_times(prof, cuda: bool) -> dict[str, tuple[float, int]]:
    """(milliseconds, count) of own time per kernel (GPU) or per operator (CPU)."""
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        if cuda:
            if (event.device_type != torch.autograd.DeviceType.CUDA
                    or getattr(event, "is_user_annotation", False)):
                continue  # an operator or a named range: its kernels count on their own
            us = getattr(event, "self_device_time_total", 0)
        else:
            us = event.self_cpu_time_total
        if us:
            out[event.key][0] += us / 1e3
            out[event.key][1] += event.count
    return {name: (ms, count) for name, (ms, count) in out.items()}


def summarize(times: dict[str, tuple[float, int]], wall_ms: float) -> dict:
    """The step's wall time, the time per category and the top kernels, from ``own_times``."""
    by_category = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for name, (ms, _) in times.items():
        by_category[category(name)] += ms
    top = sorted(times.items(), key=lambda item: -item[1][0])[:TOP]
    return {"wall_ms": wall_ms, "categories_ms": by_category,
            "top": [{"name": name, "category": category(name), "ms": ms, "count": count}
                    for name, (ms, count) in top]}


def report(summary: dict) -> str:
    """``summarize``'s result as text: the categories, then the top kernels."""
    wall = summary["wall_ms"]
    lines = [f"step wall time: {wall:,.1f} ms", "", "device time by category:"]
    for cat, ms in summary["categories_ms"].items():
        lines.append(f"  {cat:<14}{ms:>12,.1f} ms  {100 * ms / wall:5.1f} % of the wall time")
    lines += ["", f"the {len(summary['top'])} kernels (on a CPU: operators) that took the most "
              "time:"]
    for k in summary["top"]:
        lines.append(f"  {k['ms']:>10,.1f} ms  {k['count']:>6}x  {k['category']:<13} "
                     f"{k['name'][:140]}")
    return "\n".join(lines) + "\n"
