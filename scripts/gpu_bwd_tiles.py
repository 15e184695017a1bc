#!/usr/bin/env python3
"""Sweep of the Triton backward's tile configurations on one CUDA GPU (about 3 minutes).

    python scripts/gpu_bwd_tiles.py          # writes $OUT/gpu_bwd_tiles.json when $OUT is set

The autotuner only sees the few points of ``kernels/lctrain_kernels/triton/configs.py``; this script times a
wider set, one fixed configuration at a time, to decide what goes into that list.
B = 1, H = 32, D = 128, bf16, causal, one saved (out, lse):

1. dK/dV kernel configs (dQ kernel held at its tuned 128x64 w8 s3);
2. dQ kernel configs (dK/dV held at the best of step 1);
3. the tuned backward and the best pair of steps 1 and 2 again at 64K, backward only.

Each row is a whole ``flash_backward`` (delta + both kernels), median CUDA-event ms, and
checked against the tuned backward (max relative error of dq, dk, dv). The table comes last.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_kernels import BF16, DEVICE, D, H, causal_flops, cuda_time, rel  # noqa: E402

from lctrain_kernels.triton import flash_backward, flash_forward  # noqa: E402

T0 = time.perf_counter()
BUDGET_S = 200.0
SEQ, LONG = 16384, 65536
DQ_FIXED = (128, 64, 3, 8)
# (BLOCK_M, BLOCK_N, num_stages, num_warps): BLOCK_M over queries, BLOCK_N over keys
DKDV = [(32, 64, 3, 4), (32, 64, 4, 4), (32, 64, 5, 4), (32, 64, 3, 8), (64, 64, 3, 4),
        (64, 64, 3, 8), (32, 128, 3, 4), (32, 128, 4, 4), (32, 128, 3, 8), (32, 128, 4, 8),
        (64, 128, 2, 8), (64, 128, 3, 8), (64, 128, 4, 8), (16, 64, 4, 4), (16, 128, 4, 4)]
DQ = [(128, 64, 3, 8), (128, 64, 4, 8), (128, 32, 3, 4), (128, 32, 4, 4), (128, 32, 3, 8),
      (64, 64, 3, 4), (64, 64, 4, 4), (128, 128, 2, 8), (64, 32, 4, 4)]


def save_report(stem: str, rows: list[dict], t0: float) -> dict:
    """The run's rows with machine and versions; written to $OUT/<stem>.json when $OUT is set."""
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "rows": rows,
              "wall_s": time.perf_counter() - t0}
    if os.environ.get("OUT"):
        (pathlib.Path(os.environ["OUT"]) / f"{stem}.json").write_text(json.dumps(report, indent=1))
    return report


def cfg(point) -> dict:
    bm, bn, s, w = point
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_stages": s, "num_warps": w}


def name(point) -> str:
    return f"{point[0]}x{point[1]} s{point[2]} w{point[3]}"


def inputs(seq):
    q, k, v, do = (torch.randn(1, seq, H, D, device=DEVICE, dtype=BF16) for _ in range(4))
    out, lse = flash_forward(q, k, v, causal=True)
    return q, k, v, do, out, lse


def run(rows, label, seq, data, ref, **kw) -> dict:
    q, k, v, do, out, lse = data
    call = lambda: flash_backward(do, q, k, v, out, lse, causal=True, **kw)  # noqa: E731
    row = {"sweep": label, "seq": seq}
    try:
        got = call()
        err = max(rel(g, r) for g, r in zip(got, ref))
        t = cuda_time(call, min_iters=5, target_ms=150.0)
        row.update(ms=t["median"], tflops=2.5 * causal_flops(seq) / (t["median"] * 1e-3) / 1e12,
                   max_rel_err=err)
    except Exception as exc:  # noqa: BLE001 - out of resources, compile error: a result too
        row["error"] = f"{type(exc).__name__}: {exc}"[:160]
    rows.append(row)
    print(f"[{label}] {row}", flush=True)
    return row


def sweep(rows, label, seq, data, ref, points, make_kw):
    done = []
    for p in points:
        if time.perf_counter() - T0 > BUDGET_S:
            rows.append({"sweep": label, "config": name(p), "error": "skipped (time budget)"})
            continue
        row = run(rows, label, seq, data, ref, **make_kw(p))
        row["config"] = name(p)
        if "ms" in row and row["max_rel_err"] < 2e-2:
            done.append((row["ms"], p))
    return min(done)[1] if done else None


def main() -> int:
    torch.manual_seed(0)
    data = inputs(SEQ)
    q, k, v, do, out, lse = data
    ref = [x.clone() for x in flash_backward(do, q, k, v, out, lse, causal=True)]  # tuned
    rows: list[dict] = []
    run(rows, "tuned separate", SEQ, data, ref)
    rows[-1]["config"] = "autotuned"
    best_dkdv = sweep(rows, "dkdv", SEQ, data, ref, DKDV,
                      lambda p: {"dkdv_config": cfg(p), "dq_config": cfg(DQ_FIXED)})
    best_dkdv = best_dkdv or DKDV[0]
    best_dq = sweep(rows, "dq", SEQ, data, ref, DQ,
                    lambda p: {"dkdv_config": cfg(best_dkdv), "dq_config": cfg(p)}) or DQ_FIXED
    del data, ref
    torch.cuda.empty_cache()
    long = inputs(LONG)
    q, k, v, do, out, lse = long
    ref = [x.clone() for x in flash_backward(do, q, k, v, out, lse, causal=True)]
    run(rows, "64K tuned separate", LONG, long, ref)
    rows[-1]["config"] = "autotuned"
    run(rows, "64K best separate", LONG, long, ref, dkdv_config=cfg(best_dkdv),
        dq_config=cfg(best_dq))
    rows[-1]["config"] = f"dkdv {name(best_dkdv)} + dq {name(best_dq)}"
    report = save_report("gpu_bwd_tiles", rows, T0)
    print(f"\n== backward tiles: {report['device']}, torch {report['torch']}, triton "
          f"{report['triton']}, {report['wall_s']:.0f} s; bwd TFLOP/s = 2.5 x causal fwd ==")
    for r in rows:
        cell = (f"{r['ms']:8.2f} ms {r['tflops']:5.0f} TFLOP/s err {r['max_rel_err']:.1e}"
                if "ms" in r else r.get("error", "?")[:70])
        print(f"  {r['sweep']:<20} {r.get('config', ''):<34} {cell}")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("scripts/gpu_bwd_tiles.py needs a CUDA GPU.")
    sys.exit(main())
