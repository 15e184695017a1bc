#!/usr/bin/env python3
"""Packed documents on one CUDA GPU: docsplit against our Triton kernel and dense cuDNN (~4 min).

    python scripts/gpu_docsplit.py          # writes $OUT/gpu_docsplit.json when $OUT is set

B = 1, H = 32, D = 128, bf16, causal, 64K tokens cut into documents by ``--documents``-style
specs (``lctrain.bench.documents``). TFLOP/s count the useful work only (2·ΣL²·H·D forward,
backward 2.5x), medians of CUDA-event timings after warm-up; "of dense" divides by cuDNN's
dense causal 64K fwd+bwd rate measured in the same run.

1. The table: docsplit and triton on 8x8k, the realistic mix, 32x2k, 64x1k and two
   log-normal mixes (ragged lengths: dense pieces on the shape ladder plus masked ends), with
   docsplit's largest relative difference from triton's output and gradients.
2. The short-document threshold: docsplit's ``min_dense`` at 256..2048 on mixes of short
   documents, against triton.
3. cuDNN's plan per new shape: first call against a warm call on fresh lengths, and docsplit
   with and without the shape ladder on a fresh log-normal draw (first and warm calls).
"""
from __future__ import annotations

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_bwd_tiles import save_report  # noqa: E402
from gpu_kernels import cuda_time  # noqa: E402

from lctrain.bench.documents import parse_documents  # noqa: E402
from lctrain_kernels.backends import get_backend  # noqa: E402
from lctrain_kernels.backends.docsplit import DocSplitBackend  # noqa: E402
from lctrain_kernels.masks import MaskSpec, classify  # noqa: E402

S, H, D = 65536, 32, 128
MIXES = ["8x8k", "20k,12k,9k,7k,5k,4k,3x2k,1k", "32x2k", "64x1k", "lognormal:mean=12k",
         "lognormal:median=2k,sigma=0.8"]
SHORT = ["64x1k", "128x512", "lognormal:median=1k,sigma=0.6"]


def inputs(hkv: int = H):
    q, do = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, S, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, do


def measure(backend, tensors, bounds, flops: float) -> dict:
    """fwd / bwd ms (median) and TFLOP/s per useful FLOP of one backend on one mask."""
    q, k, v, do = tensors
    spec = MaskSpec(True, doc_bounds=bounds)
    rel, scale = classify(spec, S, S), D ** -0.5
    out, lse = backend.forward(q, k, v, spec, rel, scale)
    grads = backend.backward(do, q, k, v, out, lse, spec, rel, scale)
    f = cuda_time(lambda: backend.forward(q, k, v, spec, rel, scale))["median"]
    b = cuda_time(lambda: backend.backward(do, q, k, v, out, lse, spec, rel, scale))["median"]
    return {"fwd_ms": f, "bwd_ms": b, "fwd_tflops": flops / f / 1e9,
            "bwd_tflops": 2.5 * flops / b / 1e9, "total_tflops": 3.5 * flops / (f + b) / 1e9,
            "result": (out, *grads)}


def max_rel(a, b) -> float:
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
               for x, y in zip(a, b))


def table(rows: list, dense_total: float) -> None:
    tensors = inputs()
    for spec in MIXES:
        docs = parse_documents(spec, S)
        flops = docs.forward_flops(H, D)
        got = {name: measure(get_backend(name), tensors, docs.cu_seqlens, flops)
               for name in ("docsplit", "triton")}
        diff = max_rel(got["docsplit"].pop("result"), got["triton"].pop("result"))
        for name, r in got.items():
            rows.append({"part": "table", "mix": spec, "docs": docs.summary(), "backend": name,
                         **r, "of_dense": r["total_tflops"] / dense_total,
                         "max_rel_diff_vs_triton": diff})
            print(rows[-1], flush=True)


def threshold(rows: list) -> None:
    tensors = inputs()
    for spec in SHORT:
        docs = parse_documents(spec, S)
        flops = docs.forward_flops(H, D)
        cands = [("triton", get_backend("triton"))] + [
            (f"docsplit min_dense={m}", DocSplitBackend(min_dense=m))
            for m in (256, 512, 1024, 2048)]
        for name, backend in cands:
            r = measure(backend, tensors, docs.cu_seqlens, flops)
            r.pop("result")
            rows.append({"part": "threshold", "mix": spec, "backend": name, **r})
            print(rows[-1], flush=True)


def first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def plan_cost(rows: list) -> None:
    tensors = inputs()
    cudnn = get_backend("cudnn")
    for n in (8000, 8061, 12345):  # lengths no other part of this run used
        q, k, v, do = (t[:, :n] for t in tensors)
        spec = MaskSpec(True)
        rel = classify(spec, n, n)

        def both():
            out, lse = cudnn.forward(q, k, v, spec, rel, D ** -0.5)
            cudnn.backward(do, q, k, v, out, lse, spec, rel, D ** -0.5)
        first, warm = first_call_ms(both), first_call_ms(both)
        rows.append({"part": "plan", "what": f"cudnn causal {n}", "first_ms": first,
                     "warm_ms": warm})
        print(rows[-1], flush=True)
    for steps in (32, 0):
        docs = parse_documents(f"lognormal:mean=6k,seed={11 + steps}", S)
        backend = DocSplitBackend(shape_steps=steps)
        q, k, v, do = tensors
        spec = MaskSpec(True, doc_bounds=docs.cu_seqlens)
        rel = classify(spec, S, S)

        def both():
            out, lse = backend.forward(q, k, v, spec, rel, D ** -0.5)
            backend.backward(do, q, k, v, out, lse, spec, rel, D ** -0.5)
        first, warm = first_call_ms(both), first_call_ms(both)
        rows.append({"part": "plan", "what": f"docsplit shape_steps={steps} {docs.summary()}",
                     "first_ms": first, "warm_ms": warm})
        print(rows[-1], flush=True)


def main() -> int:
    t0 = time.perf_counter()
    rows: list[dict] = []
    tensors = inputs()
    dense = measure(get_backend("cudnn"), tensors, None, 2.0 * S * S * H * D)
    dense.pop("result")
    rows.append({"part": "table", "mix": "dense 64k", "backend": "cudnn", **dense, "of_dense": 1.0})
    del tensors
    table(rows, dense["total_tflops"])
    threshold(rows)
    plan_cost(rows)
    report = save_report("gpu_docsplit", rows, t0)
    print(f"\n== packed documents at 64K: {report['device']}, torch {report['torch']}, cuDNN "
          f"{torch.backends.cudnn.version()}, triton {report['triton']}, {report['wall_s']:.0f} s "
          f"==\nTFLOP/s per useful FLOP (fwd / bwd / fwd+bwd), share of cuDNN dense causal fwd+bwd")
    for r in rows:
        if r["part"] in ("table", "threshold"):
            extra = f" {r['of_dense']:5.0%} of dense" if "of_dense" in r else ""
            diff = r.get("max_rel_diff_vs_triton")
            diff = f"  diff {diff:.1e}" if diff is not None else ""
            print(f"  {r['mix']:<32} {r['backend']:<24} {r['fwd_tflops']:5.0f} / "
                  f"{r['bwd_tflops']:5.0f} / {r['total_tflops']:5.0f}{extra}{diff}")
        else:
            print(f"  {r['what']:<70} first {r['first_ms']:8.1f} ms, warm {r['warm_ms']:7.1f} ms")
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("scripts/gpu_docsplit.py needs a CUDA GPU.")
    sys.exit(main())
