#!/usr/bin/env python3
"""Distributed attention on 2 GPUs, side by side in one run, in about 8 minutes (every variant at 512K included).

    python scripts/gpu_attention.py [64,128]   # writes $OUT/gpu_attention.json when $OUT is set

Needs lctrain installed (on the lent GPU machine: ``. scripts/gpu_setup.sh`` first).

Total sequence 64K, 128K, 256K, 512K; bf16, batch 1, 32 heads, head dim 128, causal. Variants:
lctrain distflash (overlap on, and off as the ablation), ring, zigzag; torch context_parallel on
cuDNN (and ring-flash-attn if installed); the single-GPU cuDNN kernel at the same TOTAL length
(up to 256K) as the per-GPU rate to match. Each schedule is first checked for correctness
against the float32 reference at 4K tokens (error at most 2x the single-GPU kernel's). Timing:
CUDA events on every rank, 1 warm-up, median of at least 5, the slowest rank's median; per-GPU TFLOP/s
with causal fwd = 2*S^2*H*D of the whole sequence / GPUs, bwd = 2.5x; short lengths repeat
until about 2 s of timing (at 64K: about 17 iterations). A time budget skips
the measurements that would overrun (their rows say so). The table comes LAST.

Targets (shared/PERF.md): distflash >= 97 % of single-GPU cuDNN per-GPU rate at 256K, >= 92 % at
64K, and ahead of context_parallel at every length.
"""
from __future__ import annotations

import os
import pathlib
import sys
import time

import torch

from lctrain.bench.attention import run

SEQ_LENS = [65536, 131072, 262144, 524288]  # or the K's given as "64,128" in argv[1]
BUDGET_S = 480.0


def verdicts(rows: list[dict]) -> list[str]:
    """One line per target of shared/PERF.md, PASS or FAIL with the figures."""
    by = {(r["seq_len"], r["variant"]): r for r in rows}
    lines = []
    for seq_len, want in ((65536, 0.92), (262144, 0.97)):
        ratio = by.get((seq_len, "distflash"), {}).get("vs_single")
        ok = ratio is not None and ratio >= want
        lines.append(f"{'PASS' if ok else 'FAIL'}  distflash / single-GPU cuDNN at {seq_len // 1024}K: "
                     f"{ratio if ratio is None else round(ratio, 3)} (target >= {want})")
    for seq_len in SEQ_LENS:
        ours = by.get((seq_len, "distflash"), {}).get("total_tflops")
        peer = by.get((seq_len, "context_parallel"), {}).get("total_tflops")
        if ours and peer:
            lines.append(f"{'PASS' if ours > peer else 'FAIL'}  distflash {ours:.0f} vs context_parallel "
                         f"{peer:.0f} TFLOP/s per GPU at {seq_len // 1024}K")
    bad = [f"{r['variant']}@{r['seq_len']}" for r in rows if r.get("correct") is False]
    lines.append("PASS  every schedule correct" if not bad else f"FAIL  incorrect: {', '.join(bad)}")
    return lines


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    seq_lens = [int(k) * 1024 for k in sys.argv[1].split(",")] if len(sys.argv) > 1 else SEQ_LENS
    result = run(seq_lens, nproc=2, heads=32, head_dim=128, dtype=torch.bfloat16, overlap_ablation=True,
                 peers=True, repeats=5, warmup=1, check_len=4096, single_max_len=262144,
                 time_budget_s=BUDGET_S, min_time_s=2.0)
    result.meta["wall_s"] = round(time.perf_counter() - t0, 1)
    out_dir = pathlib.Path(os.environ.get("OUT", "."))
    path = out_dir / "gpu_attention.json"
    path.write_text(result.to_json())
    try:
        result.plot(out_dir / "gpu_attention.png")
    except RuntimeError as exc:  # matplotlib missing
        print(f"no plot: {exc}")
    from rich.console import Console

    console = Console(width=220)
    print(f"wrote {path}; {result.meta['device']}, torch {result.meta['torch']}, {result.meta['wall_s']} s")
    for line in verdicts(result.rows):
        print(line)
    console.print(result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
