#!/usr/bin/env python3
"""Our Triton backward against torch's compiled flex_attention backward, one GPU, ~2 minutes.

    python scripts/gpu_flex_bwd.py [16,64]    # K's; writes $OUT/gpu_flex_bwd.json when $OUT is set

Why (#3): on an H200 (third session) flex's Triton-generated backward took 13.8 ms at 16K
causal, ours 15.3 ms (398 against ~359 TFLOP/s), while at 64K flex fell to 312 and ours stayed
at 358. Both run 7 tile products (a dK/dV pass and a dQ pass); flex's tiles for sm90, D = 128,
are the ones our sweep also tried (dK/dV 64 x 128, dQ 128 x 64, 3 stages, 8 warps), so the
difference is in the kernel bodies. This times both backwards the same way — forward + backward
through autograd minus the forward, CUDA events, median of 5 after warm-up (autotuning and
compilation happen there) — and prints our compiled kernels' registers and spills, so the next
step (reading flex's generated kernel, ``TORCH_LOGS=output_code``) starts from numbers.
bf16, B = 1, H = 32, D = 128, causal. On a CPU it runs a tiny smoke test (ours only: flex has
no CPU backward).
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from lctrain.bench.kernel import timings_ms
from lctrain_kernels import attention
from lctrain_kernels.triton import launch

H, D = 32, 128


def timed_ms(fn) -> float:
    """Median of 5 timed calls after 1 warm-up, in ms (the host clock on a CPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return statistics.median(timings_ms(fn, device, repeats=5, warmup=1))


def kernel_stats() -> dict:
    """Registers and spills of our compiled backward kernels (best autotuned configs)."""
    stats = {}
    for name, tuned in (("dkdv", launch.dkdv_tuned), ("dq", launch.dq_tuned)):
        try:
            for cache in tuned.fn.device_caches.values():
                for kernel in cache[0].values():
                    stats.setdefault(name, []).append(
                        {"regs": kernel.n_regs, "spills": kernel.n_spills,
                         "shared": kernel.metadata.shared, "warps": kernel.metadata.num_warps})
        except (AttributeError, TypeError) as exc:  # Triton internals differ between versions
            stats[name] = f"unavailable: {exc}"
    return stats


def main() -> None:
    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    seqs = [int(x) * 1024 for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16384, 65536]
    if not cuda:
        seqs = [256]
    heads = H if cuda else 2
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for s in seqs:
        q, k, v, do = (torch.randn(1, heads, s, D, device=dev, dtype=dtype, requires_grad=i < 3)
                       for i in range(4))  # (B, H, S, D) for flex
        mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, s, s, device=dev)
        qs, ks, vs = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))  # (B, S, H, D)
        dos = do.transpose(1, 2)
        backend = "triton" if cuda else "reference"
        cases = {"ours": (lambda: attention(qs, ks, vs, causal=True, backend=backend), (qs, ks, vs), dos)}
        if cuda:  # flex has no backward on a CPU
            cases["flex"] = (lambda: flex(q, k, v, block_mask=mask), (q, k, v), do)
        for name, (fwd, inputs, grad) in cases.items():
            f_ms = timed_ms(fwd)
            fb_ms = timed_ms(lambda: torch.autograd.grad(fwd(), inputs, grad))
            flops = 2.0 * s * s * heads * D  # causal forward
            rows.append({"seq": s, "kernel": name, "fwd_ms": f_ms, "bwd_ms": fb_ms - f_ms,
                         "fwd_tflops": flops / f_ms / 1e9 if f_ms else None,
                         "bwd_tflops": 2.5 * flops / (fb_ms - f_ms) / 1e9 if fb_ms > f_ms else None})
            print(json.dumps(rows[-1]), flush=True)
        del q, k, v, do, qs, ks, vs
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "rows": rows, "our_kernels": kernel_stats() if cuda else {}}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_flex_bwd.json"), "w") as f:
            json.dump(report, f, indent=1)
    print(f"\nour compiled backward kernels: {json.dumps(report['our_kernels'])}")
    print(f"== backward, {report['device']}, torch {report['torch']}, causal, H={heads}, D={D} ==")
    for r in rows:
        tf = "-" if r["bwd_tflops"] is None else f"{r['bwd_tflops']:.0f}"
        print(f"{r['seq'] // 1024:>5}K  {r['kernel']:<5} fwd {r['fwd_ms']:8.2f} ms  "
              f"bwd {r['bwd_ms']:8.2f} ms  {tf:>5} TFLOP/s")


if __name__ == "__main__":
    main()
