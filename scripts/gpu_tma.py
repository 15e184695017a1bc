#!/usr/bin/env python3
"""Our Triton kernels with TMA tile loads against per-thread loads, one GPU, ~4 minutes (#3).

    python scripts/gpu_tma.py [16,64]       # K's; writes $OUT/gpu_tma.json when $OUT is set

Both paths are the same kernels (``TMA`` constexpr, chosen by ``launch.tma_ok``), so this
switches ``tma_ok`` on and off and, in one run: checks forward, lse and gradients of each path
against the float32 reference at 2K (MHA and GQA, D = 128 and 80, causal and 8 documents),
times forward and backward (CUDA events, median of 5 after autotuning and warm-up), splits
the backward into its kernels with the profiler, and prints the compiled kernels' registers
and spills. Then torch's flex_attention at the first length, timed the same way (the lead from session 4:
its backward beat ours at 16K; ``TORCH_LOGS=output_code`` prints its generated kernel).
bf16, B = 1, H = 32, D = 128, causal.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from lctrain.bench.kernel import check_correctness, timings_ms
from lctrain_kernels.backends import get_backend
from lctrain_kernels.triton import flash_backward, flash_forward, launch

H, D = 32, 128
OUT = os.environ.get("OUT")


def med_ms(fn) -> float:
    return statistics.median(timings_ms(fn, torch.device("cuda"), repeats=5, warmup=2))


def kernel_stats() -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of our kernels."""
    rows = []
    for name, tuned in (("fwd", launch.fwd_tuned), ("dkdv", launch.dkdv_tuned),
                        ("dq", launch.dq_tuned)):
        for cache in tuned.fn.device_caches.values():
            for kernel in cache[0].values():
                names = tuned.fn.arg_names
                consts = {names[k[0]] if isinstance(k, tuple) else k: v
                          for k, v in getattr(kernel.src, "constants", {}).items()}
                rows.append({"kernel": name, "regs": kernel.n_regs, "spills": kernel.n_spills,
                             "shared": kernel.metadata.shared, "warps": kernel.metadata.num_warps,
                             "stages": kernel.metadata.num_stages,
                             "consts": {k: v for k, v in consts.items()
                                        if k in ("BLOCK_M", "BLOCK_N", "TMA", "MASK_MODE")}})
        rows.append({"kernel": name, "best": {str(k): str(v) for k, v in tuned.cache.items()}})
    return rows


def kernel_split_ms(fn, iters: int = 3) -> dict:
    """Mean CUDA time per call of each kernel launched by ``fn`` (profiler)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" or getattr(evt, "device_time_total", 0):
            t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            if t:
                out[evt.key[:60]] = round(t / iters / 1e3, 3)
    return out


def main() -> None:
    seqs = [int(x) * 1024 for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16384, 65536]
    dev, dt = torch.device("cuda"), torch.bfloat16
    real_ok = launch.tma_ok
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "checks": [], "rows": []}
    backend = get_backend("triton")
    for tma in (False, True):
        launch.tma_ok = real_ok if tma else (lambda *t: False)
        for kv, hd, docs in ((H, D, None), (8, D, None), (H, 80, None), (H, D, 8)):
            err = check_correctness(backend, 2048, H, kv, hd, dt, dev, True, docs)
            report["checks"].append({"tma": tma, "kv_heads": kv, "head_dim": hd, "docs": docs,
                                     "max_rel_err": err})
            print(json.dumps(report["checks"][-1]), flush=True)
    for s in seqs:
        q, k, v, do = (torch.randn(1, s, H, D, device=dev, dtype=dt) for _ in range(4))
        outs = {}
        for tma in (False, True):
            launch.tma_ok = real_ok if tma else (lambda *t: False)
            out, lse = flash_forward(q, k, v, causal=True)
            grads = flash_backward(do, q, k, v, out, lse, causal=True)
            outs[tma] = (out, lse, *grads)
            f_ms = med_ms(lambda: flash_forward(q, k, v, causal=True))
            b_ms = med_ms(lambda: flash_backward(do, q, k, v, out, lse, causal=True))
            split = kernel_split_ms(lambda: flash_backward(do, q, k, v, out, lse, causal=True))
            flops = 2.0 * s * s * H * D
            row = {"seq": s, "tma": tma, "fwd_ms": f_ms, "bwd_ms": b_ms,
                   "fwd_tflops": flops / f_ms / 1e9, "bwd_tflops": 2.5 * flops / b_ms / 1e9,
                   "total_tflops": 3.5 * flops / (f_ms + b_ms) / 1e9, "bwd_kernels_ms": split}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(outs[False], outs[True])]
        print(f"{s // 1024}K max |TMA - no TMA| over out, lse, dq, dk, dv: {diffs}", flush=True)
        del q, k, v, do, outs
        torch.cuda.empty_cache()
    launch.tma_ok = real_ok
    report["kernels"] = kernel_stats()
    for r in report["kernels"]:
        print(json.dumps(r), flush=True)
    report["flex"] = flex_row(seqs[0])
    if OUT:
        with open(os.path.join(OUT, "gpu_tma.json"), "w") as f:
            json.dump(report, f, indent=1)
    print(f"\n== {report['device']}, torch {report['torch']}, triton {report['triton']}; "
          f"bf16 causal H={H} D={D}; TFLOP/s (bwd 2.5x, total 3.5x causal fwd) ==")
    for r in report["rows"]:
        print(f"{r['seq'] // 1024:>4}K tma={r['tma']!s:<5} fwd {r['fwd_ms']:8.2f} ms "
              f"{r['fwd_tflops']:4.0f}  bwd {r['bwd_ms']:8.2f} ms {r['bwd_tflops']:4.0f}  "
              f"total {r['total_tflops']:4.0f}")
    fl = report["flex"]
    if fl:
        print(f"{fl['seq'] // 1024:>4}K flex      fwd {fl['fwd_ms']:8.2f} ms  bwd "
              f"{fl['bwd_ms']:8.2f} ms {fl['bwd_tflops']:4.0f}  split {fl['bwd_kernels_ms']}")


def flex_row(s: int) -> dict:
    """flex_attention at ``s``: forward, backward (fwd+bwd minus fwd), its backward kernels."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    q, k, v, do = (torch.randn(1, H, s, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=i < 3) for i in range(4))
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, s, s, device="cuda")
    fwd = lambda: flex(q, k, v, block_mask=mask)  # noqa: E731
    step = lambda: torch.autograd.grad(fwd(), (q, k, v), do)  # noqa: E731
    f_ms, fb_ms = med_ms(fwd), med_ms(step)
    split = kernel_split_ms(step)
    flops = 2.0 * s * s * H * D
    row = {"seq": s, "fwd_ms": f_ms, "bwd_ms": fb_ms - f_ms,
           "bwd_tflops": 2.5 * flops / (fb_ms - f_ms) / 1e9, "bwd_kernels_ms": split}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
