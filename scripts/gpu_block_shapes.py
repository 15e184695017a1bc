#!/usr/bin/env python3
"""cuDNN's rate on the block shapes the distributed schedules hand it (about 1 minute, 1 GPU).

    python scripts/gpu_block_shapes.py      # writes $OUT/gpu_block_shapes.json when $OUT is set

One GPU's cuDNN forward falls from ~600 TFLOP/s at 64K causal to ~507 at 256K, while its
backward stays near 535; at 512K total over 2 GPUs distflash's forward (blocks of 128K-256K
rows) is 4 % slower than zigzag's (blocks of 128K). This measures forward and backward
TFLOP/s of single blocks — square causal, top-left causal (distflash's first step), full
rectangles — so a split of long blocks into shorter key or query runs can be judged from data.
bf16, B=1, 32 heads, D=128, CUDA events, median of 3 after 1 warm-up. Needs lctrain installed.
"""
from __future__ import annotations

import json
import os
import statistics

import torch

from lctrain.bench.kernel import timings_ms
from lctrain_kernels.blocks import block_backward, block_forward
from lctrain_kernels.masks import MaskSpec

K = 1024
HEADS, DIM = 32, 128
CASES = [  # (name, Sq, Sk, causal): causal blocks share q_start == k_start (top-left)
    ("causal", 32 * K, 32 * K, True), ("causal", 64 * K, 64 * K, True),
    ("causal", 128 * K, 128 * K, True), ("causal", 256 * K, 256 * K, True),
    ("causal top-left", 256 * K, 128 * K, True), ("causal top-left", 128 * K, 64 * K, True),
    ("full", 32 * K, 32 * K, False), ("full", 64 * K, 64 * K, False),
    ("full", 128 * K, 128 * K, False), ("full", 128 * K, 32 * K, False),
    ("full", 32 * K, 128 * K, False), ("full", 128 * K, 256 * K, False),
    ("full", 256 * K, 64 * K, False),
]


def flops(sq: int, sk: int, causal: bool) -> float:
    """Forward FLOPs: 4 * visible area * H * D (top-left causal area for Sq >= Sk)."""
    area = sq * sk if not causal else sk * sk / 2 + (sq - sk) * sk
    return 4.0 * area * HEADS * DIM


def timed(fn) -> float:
    """Median of 3 timed calls after 1 warm-up, in ms."""
    return statistics.median(timings_ms(fn, torch.device("cuda"), repeats=3, warmup=1))


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for name, sq, sk, causal in CASES:
        q = torch.randn(1, sq, HEADS, DIM, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, sk, HEADS, DIM, device=dev, dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        spec = MaskSpec(causal)
        out, lse = block_forward(q, k, v, spec, scale=DIM ** -0.5, backend="cudnn")
        f_ms = timed(lambda: block_forward(q, k, v, spec, scale=DIM ** -0.5, backend="cudnn"))
        b_ms = timed(lambda: block_backward(do, q, k, v, out, lse, spec, scale=DIM ** -0.5,
                                            backend="cudnn"))
        fl = flops(sq, sk, causal)
        rows.append({"case": name, "sq": sq, "sk": sk, "fwd_ms": f_ms, "bwd_ms": b_ms,
                     "fwd_tflops": fl / f_ms / 1e9, "bwd_tflops": 2.5 * fl / b_ms / 1e9})
        print(json.dumps(rows[-1]), flush=True)
        del q, k, v, do, out, lse
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_block_shapes.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    print(f"\n== cuDNN blocks, {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
          f"B=1, H={HEADS}, D={DIM} ==")
    print(f"{'case':<16} {'Sq':>6} {'Sk':>6} {'fwd ms':>9} {'bwd ms':>9} {'fwd TF/s':>9} {'bwd TF/s':>9}")
    for r in rows:
        print(f"{r['case']:<16} {r['sq'] // K:>5}K {r['sk'] // K:>5}K {r['fwd_ms']:9.1f} "
              f"{r['bwd_ms']:9.1f} {r['fwd_tflops']:9.0f} {r['bwd_tflops']:9.0f}")


if __name__ == "__main__":
    main()
