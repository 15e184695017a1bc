#!/usr/bin/env python3
"""Packed documents on one CUDA GPU: docsplit's cost model calibrated, then docsplit against
our Triton kernel and dense cuDNN (a few minutes on an H200).

    python scripts/gpu_docsplit.py          # writes $OUT/gpu_docsplit.json when $OUT is set

B = 1, H = 32, D = 128, bf16, causal. TFLOP/s count the useful work only (2·ΣL²·H·D forward,
backward 2.5x), medians of CUDA-event timings after warm-up; "of dense" divides by cuDNN's
dense causal 64K fwd+bwd rate measured in the same run.

1. Calibration of :class:`lctrain_kernels.docsplit_cost.CostModel`: rates and per-row terms
   from one batched call of equal documents at several lengths (cuDNN on views, Triton on the
   64K block), the gather term from one gathered batch against the same batch as a view, and
   the per-call costs from 64 back-to-back calls on tiny documents (host-bound), each through
   the docsplit backend on a fixed plan so its own bookkeeping counts. Printed as a
   ``CostModel(...)`` to paste into ``GPU_MODEL``.
2. New shapes: docsplit's first call (plans, cuDNN graphs, Triton tunings) on a fresh
   log-normal draw against a warm call, then on a second fresh draw: how fast the shape
   ladders fill the caches.
3. The table (printed last): for each mix docsplit (cost model on), docsplit forced dense,
   triton, with the model's predicted milliseconds, the plan docsplit ran, and its largest
   relative difference from triton's output and gradients; cuDNN dense causal 64K on top.
"""
from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import time

import torch

from lctrain.bench.documents import parse_documents
from lctrain_kernels.backends import get_backend
from lctrain_kernels.backends.docsplit import DocSplitBackend
from lctrain_kernels.docsplit import DenseCall, MaskedCall, Split
from lctrain_kernels.docsplit_cost import FLOPS_PER_PAIR, GPU_MODEL, CostModel
from lctrain_kernels.masks import MaskSpec, classify

S, H, D = 65536, 32, 128
WORK = H * D  # B * Hq * D of every block here
MIXES = ["8x8k", "20k,12k,9k,7k,5k,4k,3x2k,1k", "32x2k", "64x1k", "128x512",
         "lognormal:mean=12k", "lognormal:median=2k,sigma=0.8", "lognormal:median=1k,sigma=0.6"]
FRESH = ["lognormal:mean=6k,seed=101", "lognormal:mean=6k,seed=102"]
DENSE_LENGTHS = (1024, 2048, 4096, 8192, 16384)  # rates: one batched call at each length
MASKED_LENGTHS = (512, 1024, 2048, 4096, 8192)
GATHER_LENGTH = 2048  # the gather term: this length gathered against the same as a view
TINY, CALLS = 256, 64  # per-call costs: 64 documents of 256 rows


def cuda_time(fn, min_iters=5, target_ms=250.0) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    iters = int(min(30, max(min_iters, target_ms / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def inputs(n: int = S):
    q, k, v, do = (torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    return q, k, v, do


def fwd_bwd(backend, tensors, bounds):
    """(forward, backward) closures of one backend on the causal block with these bounds."""
    q, k, v, do = tensors
    spec = MaskSpec(True, doc_bounds=bounds)
    rel, scale = classify(spec, q.shape[1], k.shape[1]), D ** -0.5
    out, lse = backend.forward(q, k, v, spec, rel, scale)
    return (lambda: backend.forward(q, k, v, spec, rel, scale),
            lambda: backend.backward(do, q, k, v, out, lse, spec, rel, scale))


def both(backend, tensors, bounds):
    """Forward then backward, from nothing (the first call of a block): out, lse and grads."""
    q, k, v, do = tensors
    spec = MaskSpec(True, doc_bounds=bounds)
    rel, scale = classify(spec, q.shape[1], k.shape[1]), D ** -0.5
    out, lse = backend.forward(q, k, v, spec, rel, scale)
    return (out, lse, *backend.backward(do, q, k, v, out, lse, spec, rel, scale))


def time_fwd_bwd(backend, tensors, bounds) -> tuple[float, float]:
    f, b = fwd_bwd(backend, tensors, bounds)
    return cuda_time(f), cuda_time(b)


class FixedPlan(DocSplitBackend):
    """The docsplit backend running one given plan, whatever the block (for calibration)."""

    def __init__(self, split: Split):
        super().__init__()
        self.split = split

    def plan(self, q, spec, sk):
        return self.split


def fit(points) -> tuple[float, float]:
    """Least squares ``us = alpha * pairs + beta * rows`` over (pairs, rows, us) points."""
    a = torch.tensor([[p, r] for p, r, _ in points], dtype=torch.float64)
    y = torch.tensor([[t] for _, _, t in points], dtype=torch.float64)
    alpha, beta = torch.linalg.lstsq(a, y).solution.flatten().tolist()
    return alpha, beta


def rate_points(backend_of, lengths, tensors, rows: list) -> list:
    """(pairs, rows, µs) of fwd+bwd of n documents of L at each length, one call each."""
    points = []
    for length in lengths:
        n = S // length
        bounds = tuple(range(0, S + 1, length))
        f, b = time_fwd_bwd(backend_of(n, length), tensors, bounds)
        points.append((n * length * (length + 1) // 2, S, (f + b) * 1e3))
        rows.append({"part": "calibration", "what": f"{backend_of.__name__} {n}x{length}",
                     "fwd_ms": f, "bwd_ms": b})
        print(rows[-1], flush=True)
    return points


def calibrate(rows: list) -> CostModel:
    """Fit the cost model on this GPU (module docstring, part 1)."""
    tensors = inputs()

    def dense_view(n, length):
        starts = tuple(range(0, S, length))
        return FixedPlan(Split((DenseCall(length, length, True, starts, starts, (length,) * n),),
                               (), None, 0, 0))

    def masked(n, length):
        return get_backend("triton")

    alpha_d, beta_d = fit(rate_points(dense_view, DENSE_LENGTHS, tensors, rows))
    alpha_m, beta_m = fit(rate_points(masked, MASKED_LENGTHS, tensors, rows))
    per_pair = FLOPS_PER_PAIR * WORK / 1e6  # µs * TFLOP/s per pair
    n, length = S // GATHER_LENGTH, GATHER_LENGTH
    starts = tuple(range(0, S, length))
    gathered = Split((DenseCall(length, length, True, starts, starts, (length,) * n, True),), (),
                     None, 0, 0)
    f, b = time_fwd_bwd(FixedPlan(gathered), tensors, tuple(range(0, S + 1, length)))
    view = next(r for r in rows if r["what"] == f"dense_view {n}x{length}")
    gather_row_us = ((f + b) - (view["fwd_ms"] + view["bwd_ms"])) * 1e3 / S
    calls = call_costs(alpha_d, beta_d, alpha_m, beta_m, gather_row_us, rows)
    model = CostModel(dense_call_us=calls[0], masked_call_us=calls[1], gather_call_us=calls[2],
                      dense_tflops=per_pair / alpha_d, masked_tflops=per_pair / alpha_m,
                      dense_row_pairs=beta_d / alpha_d, masked_row_pairs=beta_m / alpha_m,
                      gather_row_pairs=gather_row_us / alpha_d)
    rows.append({"part": "calibration", "what": "model", **model.__dict__})
    print(rows[-1], flush=True)
    return model


def call_costs(alpha_d, beta_d, alpha_m, beta_m, gather_row_us, rows) -> tuple[float, ...]:
    """(dense, masked, gather) µs per call from 64 calls on tiny documents, less their work:
    dense views and gathered calls of one 256-row document each, and masked calls over two
    128-row documents each (the interval-mask mode of joined masked calls)."""
    n, length, half = CALLS, TINY, TINY // 2
    tensors, starts = inputs(n * length), list(range(0, n * length, length))
    one = lambda a, g=False: DenseCall(length, length, True, (a,), (a,), (length,), g)  # noqa
    plans = {"views": Split(tuple(one(a) for a in starts), (), None, 0, 0),
             "gathered": Split(tuple(one(a, True) for a in starts), (), None, 0, 0),
             "masked": Split((DenseCall(half, half, True, (0,), (0,), (half,)),),
                             tuple(MaskedCall(a, min(a + length, n * length), a,
                                              min(a + length, n * length))
                                   for a in range(half, n * length, length)), None, 0, 0)}
    got = {}
    for name, plan in plans.items():
        size = length if name != "masked" else half
        bounds = tuple(range(0, n * length + 1, size))
        f, b = time_fwd_bwd(FixedPlan(plan), tensors, bounds)
        got[name] = (f + b) * 1e3
        rows.append({"part": "calibration", "what": f"{len(plan.dense) + len(plan.masked)} "
                     f"{name} calls on documents of {size}", "fwd_ms": f, "bwd_ms": b})
        print(rows[-1], flush=True)
    doc = lambda m, alpha, beta: m * (m + 1) // 2 * alpha + m * beta  # noqa: E731
    dense = (got["views"] - n * doc(length, alpha_d, beta_d)) / n
    gather = (got["gathered"] - got["views"]) / n - gather_row_us * length
    masked_docs = 2 * n - 1  # every 128-row document but the first, in n masked calls
    masked = (got["masked"] - doc(half, alpha_d, beta_d) - dense
              - masked_docs * doc(half, alpha_m, beta_m)) / n
    return max(dense, 0.0), max(masked, 0.0), max(gather, 0.0)


def shapes_of(backend, tensors, bounds) -> set:
    plan = backend.plan(tensors[0], MaskSpec(True, doc_bounds=bounds), tensors[1].shape[1])
    return {(c.n, c.sq, c.sk, c.causal) for c in plan.dense}


def first_calls(rows: list) -> None:
    """docsplit on fresh draws: first call (new shapes) against a warm one."""
    tensors, backend, seen = inputs(), DocSplitBackend(), set()
    for spec in FRESH:
        docs = parse_documents(spec, S)
        first = wall_ms(lambda: both(backend, tensors, docs.cu_seqlens))
        warm = wall_ms(lambda: both(backend, tensors, docs.cu_seqlens))
        shapes = shapes_of(backend, tensors, docs.cu_seqlens)
        rows.append({"part": "first_call", "what": f"{spec}: {docs.summary()}", "first_ms": first,
                     "warm_ms": warm, "shapes": len(shapes), "new_shapes": len(shapes - seen)})
        seen |= shapes
        print(rows[-1], flush=True)


def max_rel(a, b) -> float:
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
               for x, y in zip(a, b))


def plan_text(plan: Split) -> str:
    if not plan.dense:
        return "one masked call"
    gathered, padded = sum(c.gather for c in plan.dense), sum(c.padded for c in plan.dense)
    packed = f" + packed {len(plan.packed.n)}" if plan.packed is not None else ""
    return (f"{len(plan.dense)} dense ({gathered} gathered, {padded} padded) + "
            f"{len(plan.masked)} masked{packed}")


def measure(name, backend, tensors, docs, dense_total) -> dict:
    f, b = fwd_bwd(backend, tensors, docs.cu_seqlens)
    flops = docs.forward_flops(H, D)
    fwd_ms, bwd_ms = cuda_time(f), cuda_time(b)
    row = {"part": "table", "mix": docs.spec, "docs": docs.summary(), "backend": name,
           "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tflops": flops / fwd_ms / 1e9,
           "bwd_tflops": 2.5 * flops / bwd_ms / 1e9,
           "total_tflops": 3.5 * flops / (fwd_ms + bwd_ms) / 1e9}
    row["of_dense"] = row["total_tflops"] / dense_total
    if isinstance(backend, DocSplitBackend):
        plan = backend.plan(tensors[0], MaskSpec(True, doc_bounds=docs.cu_seqlens), S)
        row.update(plan=plan_text(plan), predicted_ms=plan.cost_us / 1e3)
    else:
        row["predicted_ms"] = None
    return row


def table(rows: list) -> None:
    tensors = inputs()
    f, b = fwd_bwd(get_backend("cudnn"), tensors, None)
    fwd_ms, bwd_ms = cuda_time(f), cuda_time(b)
    dense_total = 3.5 * 2.0 * S * S * H * D / (fwd_ms + bwd_ms) / 1e9
    rows.append({"part": "table", "mix": "dense 64k", "backend": "cudnn", "fwd_ms": fwd_ms,
                 "bwd_ms": bwd_ms, "fwd_tflops": 2.0 * S * S * H * D / fwd_ms / 1e9,
                 "bwd_tflops": 5.0 * S * S * H * D / bwd_ms / 1e9, "total_tflops": dense_total,
                 "of_dense": 1.0, "predicted_ms": None})
    backends = {"docsplit": DocSplitBackend(), "docsplit forced": DocSplitBackend(force_dense=True),
                "triton": get_backend("triton")}
    for spec in MIXES:
        docs = parse_documents(spec, S)
        plan = backends["docsplit"].plan(tensors[0], MaskSpec(True, doc_bounds=docs.cu_seqlens), S)
        got, mine = {}, []
        for name, backend in backends.items():
            row = measure(name, backend, tensors, docs, dense_total)
            if name == "triton":
                row["predicted_ms"] = plan.masked_cost_us / 1e3
            got[name] = both(backend, tensors, docs.cu_seqlens)
            rows.append(row)
            mine += [row] if name != "triton" else []
            print(row, flush=True)
        for row in mine:
            row["max_rel_diff_vs_triton"] = max_rel(got[row["backend"]], got["triton"])


def render(rows: list, wall_s: float) -> None:
    print(f"\n== packed documents at 64K: {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, cuDNN {torch.backends.cudnn.version()}, triton "
          f"{__import__('triton').__version__}, {wall_s:.0f} s ==")
    model = next(r for r in rows if r.get("what") == "model")
    fields = ", ".join(f"{k}={v:.4g}" for k, v in model.items() if k not in ("part", "what"))
    print(f"calibrated: CostModel({fields})")
    for r in rows:
        if r["part"] == "first_call":
            print(f"  first call {r['what']:<70} {r['first_ms']:8.1f} ms (warm {r['warm_ms']:6.1f}"
                  f" ms), {r['new_shapes']} new of {r['shapes']} dense shapes")
    print("TFLOP/s per useful FLOP (fwd / bwd / fwd+bwd), share of cuDNN dense causal fwd+bwd, "
          "measured vs predicted ms (default GPU_MODEL)")
    for r in rows:
        if r["part"] != "table":
            continue
        pred = f"{r['fwd_ms'] + r['bwd_ms']:7.2f} ms"
        pred += f" (model {r['predicted_ms']:7.2f})" if r["predicted_ms"] is not None else " " * 16
        diff = r.get("max_rel_diff_vs_triton")
        print(f"  {r['mix']:<33} {r['backend']:<16} {r['fwd_tflops']:5.0f} / {r['bwd_tflops']:5.0f}"
              f" / {r['total_tflops']:5.0f} {r['of_dense']:5.0%}  {pred}"
              f"{f'  diff {diff:.1e}' if diff is not None else ''}  {r.get('plan', '')}")


def main() -> int:
    t0, rows = time.perf_counter(), []
    calibrate(rows)
    first_calls(rows)
    table(rows)
    wall_s = time.perf_counter() - t0
    if os.environ.get("OUT"):
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "cudnn": torch.backends.cudnn.version(),
                  "triton": __import__("triton").__version__, "default_model":
                  GPU_MODEL.__dict__, "rows": rows, "wall_s": wall_s}
        path = pathlib.Path(os.environ["OUT"]) / "gpu_docsplit.json"
        path.write_text(json.dumps(report, indent=1))
    render(rows, wall_s)
    return 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("scripts/gpu_docsplit.py needs a CUDA GPU.")
    sys.exit(main())
