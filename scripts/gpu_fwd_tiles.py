#!/usr/bin/env python3
"""Sweep of the Triton forward's tile configurations on one CUDA GPU (about 1 minute).

    python scripts/gpu_fwd_tiles.py          # writes $OUT/gpu_fwd_tiles.json when $OUT is set

The forward's autotune set (``kernels/lctrain_kernels/triton/configs.py``) was chosen with per-thread loads;
with TMA copies the kernels hold fewer registers, so deeper pipelines and taller query tiles
may now fit. This times one fixed configuration at a time at 16K and 64K (B = 1, H = 32,
D = 128, bf16, causal), each checked against the autotuned forward. The table comes last.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_bwd_tiles import cfg, name, save_report  # noqa: E402
from gpu_kernels import BF16, DEVICE, D, H, causal_flops, cuda_time, rel  # noqa: E402

from lctrain_kernels.triton import flash_forward  # noqa: E402

#: (BLOCK_M, BLOCK_N, num_stages, num_warps): BLOCK_M over queries, BLOCK_N over keys
POINTS = [(128, 128, 3, 8), (128, 128, 2, 8), (128, 64, 3, 8), (128, 64, 4, 8), (128, 64, 5, 8),
          (64, 128, 3, 4), (64, 64, 4, 4), (256, 64, 2, 8), (256, 64, 3, 8), (256, 128, 2, 8)]


def main() -> int:
    t0 = time.perf_counter()
    rows = []
    for seq in (16384, 65536):
        q, k, v = (torch.randn(1, seq, H, D, device=DEVICE, dtype=BF16) for _ in range(3))
        ref = [x.clone() for x in flash_forward(q, k, v, causal=True)]  # autotuned
        for label, point in [("autotuned", None)] + [(name(p), p) for p in POINTS]:
            call = lambda: flash_forward(q, k, v, causal=True,  # noqa: E731
                                         config=None if point is None else cfg(point))
            row = {"seq": seq, "config": label}
            try:
                got = call()
                t = cuda_time(call, min_iters=5, target_ms=150.0)
                row.update(ms=t["median"], tflops=causal_flops(seq) / (t["median"] * 1e-3) / 1e12,
                           max_rel_err=max(rel(g, r) for g, r in zip(got, ref)))
            except Exception as exc:  # noqa: BLE001 - out of resources: a result too
                row["error"] = f"{type(exc).__name__}: {exc}"[:90]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, ref
        torch.cuda.empty_cache()
    report = save_report("gpu_fwd_tiles", rows, t0)
    print(f"\n== forward tiles: {report['device']}, torch {report['torch']}, triton "
          f"{report['triton']}, {report['wall_s']:.0f} s; causal fwd TFLOP/s ==")
    for r in rows:
        cell = (f"{r['ms']:8.2f} ms {r['tflops']:5.0f} TFLOP/s err {r['max_rel_err']:.1e}"
                if "ms" in r else r["error"])
        print(f"  {r['seq'] // 1024:>3}K {r['config']:<16} {cell}")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("scripts/gpu_fwd_tiles.py needs a CUDA GPU.")
    sys.exit(main())
