#!/usr/bin/env python3
"""Where one rank's distributed attention time goes: a kernel-time breakdown (about 1 minute).

    python scripts/gpu_profile_attention.py [64] [distflash]   # total length in K, schedule

Runs the schedule's forward + backward on every GPU of the machine (NCCL; on a CPU, 2 gloo
ranks at a tiny size, as a smoke test) under ``torch.profiler`` for 3 iterations after 3 of
warm-up, and prints for rank 0: device time per category — attention kernels (cuDNN / flash /
our Triton), communication (NCCL), the distributed bookkeeping (merges, float32 gradient
sums, casts and copies) and the rest — then the 20 heaviest kernels. Wall time per iteration
is printed beside it, so the share that no kernel covers (launch gaps, waits) shows too. This
is the first step of #4 (64K over 2 GPUs at 0.919 of one GPU's cuDNN): measure before changing.
Writes ``$OUT/profile_attention.json`` and each rank's timeline ``$OUT/trace_rank{r}.json``
(chrome trace) when ``$OUT`` is set. Needs lctrain installed.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from lctrain_kernels.distributed.comm import nccl_options

CATEGORIES = (  # first match wins; names are lower-cased kernel names
    ("attention", ("fmha", "cudnn", "flash", "attn_fwd", "attn_bwd", "sdpa")),
    ("communication", ("nccl", "c10d")),
    ("bookkeeping", ("elementwise", "copy", "merge", "fill", "cat", "reduce", "vectorized",
                     "unrolled", "index")),
)


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def worker(rank: int, world: int, seq_len: int, schedule: str, store: str) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    kwargs = {"device_id": device, "pg_options": nccl_options()} if cuda else {}
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, **kwargs)
    try:
        report = profile(rank, world, seq_len, schedule, device)
        if rank == 0:
            print_report(report)
            if os.environ.get("OUT"):
                with open(os.path.join(os.environ["OUT"], "profile_attention.json"), "w") as f:
                    json.dump(report, f, indent=1)
    finally:
        dist.destroy_process_group()


def profile(rank: int, world: int, seq_len: int, schedule: str, device) -> dict:
    import lctrain_kernels.distributed  # noqa: F401 - registers torch.ops.lctrain

    heads, dim = (32, 128) if device.type == "cuda" else (2, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = seq_len // world
    gen = torch.Generator(device=device).manual_seed(rank)
    q, k, v, do = (torch.randn(1, n, heads, dim, generator=gen, device=device, dtype=dtype)
                   for _ in range(4))
    opts = (dist.group.WORLD.group_name, True, [], dim ** -0.5, schedule, "auto", True)

    def step():
        out, lse = torch.ops.lctrain.dist_attention(q, k, v, *opts)
        torch.ops.lctrain.dist_attention_backward(do, q, k, v, out, lse, *opts)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    for _ in range(3):
        step()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    iters = 3
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3 / iters
    if os.environ.get("OUT"):  # the timeline of every rank, for chrome://tracing or Perfetto
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"trace_rank{rank}.json"))
    per_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if device.type == "cuda" and evt.device_type != torch.autograd.DeviceType.CUDA:
            continue  # an operator: its kernels are listed on their own (no double count)
        us = getattr(evt, "self_device_time_total", 0) if device.type == "cuda" else evt.self_cpu_time_total
        if us:
            per_kernel[evt.key] += us / 1e3 / iters
    by_cat: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        by_cat[category(name)] += ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:20]
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "world": world, "seq_len": seq_len, "schedule": schedule,
            "wall_ms_per_iteration": wall_ms, "device_ms_per_iteration": dict(by_cat),
            "top_kernels_ms": top}


def print_report(r: dict) -> None:
    print(f"== {r['schedule']} fwd+bwd, total S = {r['seq_len']}, {r['world']} ranks, "
          f"{r['device']}, torch {r['torch']}: rank 0, per iteration ==")
    print(f"  wall {r['wall_ms_per_iteration']:.2f} ms")
    busy = sum(r["device_ms_per_iteration"].values())
    for cat, ms in sorted(r["device_ms_per_iteration"].items(), key=lambda kv: -kv[1]):
        print(f"  {cat:<14} {ms:9.2f} ms  {100 * ms / busy:5.1f} %")
    print("  heaviest kernels:")
    for name, ms in r["top_kernels_ms"]:
        print(f"    {ms:9.3f} ms  {name[:110]}")


def main() -> int:
    seq_len = int(sys.argv[1]) * 1024 if len(sys.argv) > 1 else 65536
    schedule = sys.argv[2] if len(sys.argv) > 2 else "distflash"
    world = torch.cuda.device_count() if torch.cuda.is_available() else 2
    if not torch.cuda.is_available():
        seq_len = 256  # CPU smoke test
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(worker, args=(world, seq_len, schedule, os.path.join(tmp, "s")),
                                    nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
