"""Single-device attention kernel benchmark: every local backend, side by side, in one run.

For each backend that can run the request, first a correctness check at a small length
(forward, lse and all three gradients against the float32 reference on the same inputs,
upcast), then forward and backward timings at each sequence length: warm-up, then the median
(and min/max) of ``repeats`` runs, each timed by a pair of CUDA events (``perf_counter`` on a
CPU). The backward is the flash-style one: it takes the forward's out and lse, as training does.

FLOP model (shared/PERF.md): forward = 4·H·D per visible (query, key) pair, with causal
attention counted as S²/2 pairs, i.e. causal fwd = 2·S²·H·D and non-causal 4·S²·H·D; with
``documents`` only the pairs inside each document count (so a kernel that skips the empty
tiles shows it as a higher rate, and one that does not, as a lower one); backward = 2.5×
forward. ``total`` is (fwd + bwd FLOPs) / (fwd + bwd time).
"""
from __future__ import annotations

import statistics
import time

import torch

from lctrain.bench.result import BenchResult
from lctrain_kernels.backends import BackendUnavailable, available_backends, get_backend
from lctrain_kernels.masks import MaskSpec, classify
from lctrain_kernels.reference import reference_backward, reference_forward

#: largest relative error accepted by the correctness check, per dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
_CPU_DEFAULT = ("reference", "cpu_flash")  # triton on a CPU is the (slow) interpreter


def doc_bounds(seq_len: int, documents: int | None) -> tuple[int, ...] | None:
    """Boundaries of ``documents`` packed documents of (nearly) equal length."""
    if not documents:
        return None
    if not 1 <= documents <= seq_len:
        raise ValueError(f"documents must be between 1 and the sequence length {seq_len}, "
                         f"got {documents}.")
    return tuple(round(i * seq_len / documents) for i in range(documents + 1))


def forward_flops(seq_len: int, heads: int, head_dim: int, causal: bool, bounds) -> float:
    """Forward FLOPs under the model in the module docstring."""
    lengths = [seq_len] if bounds is None else [b - a for a, b in zip(bounds, bounds[1:])]
    pairs = sum(n * n for n in lengths) * (0.5 if causal else 1.0)
    return 4.0 * pairs * heads * head_dim


def timings_ms(fn, device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (CUDA
    events on a GPU, the host clock elsewhere)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def _inputs(seq_len, heads, kv_heads, head_dim, dtype, device):
    shape_q, shape_kv = (1, seq_len, heads, head_dim), (1, seq_len, kv_heads, head_dim)
    return (torch.randn(shape_q, dtype=dtype, device=device),  # (1, S, Hq, D)
            torch.randn(shape_kv, dtype=dtype, device=device),  # (1, S, Hkv, D)
            torch.randn(shape_kv, dtype=dtype, device=device),
            torch.randn(shape_q, dtype=dtype, device=device))  # dO


def check_correctness(backend, seq_len, heads, kv_heads, head_dim, dtype, device, causal,
                      documents) -> float:
    """Worst relative error of out, lse, dq, dk, dv against the float32 reference.

    Raises:
        BackendUnavailable: if the backend cannot run this request (with its reason).
    """
    q, k, v, do = _inputs(seq_len, heads, kv_heads, head_dim, dtype, device)
    spec = MaskSpec(causal, doc_bounds=doc_bounds(seq_len, documents))
    rel, scale = classify(spec, seq_len, seq_len), head_dim ** -0.5
    reason = backend.unsupported(q, k, v, spec, rel)
    if reason is not None:
        raise BackendUnavailable(reason)
    out, lse = backend.forward(q, k, v, spec, rel, scale)
    grads = backend.backward(do, q, k, v, out, lse, spec, rel, scale)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    up = [x.to(wide) for x in (q, k, v, do)]
    ref_out, ref_lse = reference_forward(*up[:3], spec, scale)
    ref_grads = reference_backward(up[3], *up[:3], ref_out, ref_lse, spec, scale)
    errors = []
    for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        diff = (got.to(wide) - want).abs().max()
        errors.append((diff / want.abs().max().clamp_min(1e-30)).item())
    return max(errors)


def _measure(backend, seq_len, heads, kv_heads, head_dim, dtype, device, causal, documents,
             repeats, warmup) -> dict:
    q, k, v, do = _inputs(seq_len, heads, kv_heads, head_dim, dtype, device)
    bounds = doc_bounds(seq_len, documents)
    spec = MaskSpec(causal, doc_bounds=bounds)
    rel, scale = classify(spec, seq_len, seq_len), head_dim ** -0.5
    reason = backend.unsupported(q, k, v, spec, rel)
    if reason is not None:
        return {"relation": rel.value, "status": reason}
    out, lse = backend.forward(q, k, v, spec, rel, scale)
    fwd = timings_ms(lambda: backend.forward(q, k, v, spec, rel, scale), device, repeats,
                     warmup)
    bwd = timings_ms(lambda: backend.backward(do, q, k, v, out, lse, spec, rel, scale),
                     device, repeats, warmup)
    flops = forward_flops(seq_len, heads, head_dim, causal, bounds)
    f_ms, b_ms = statistics.median(fwd), statistics.median(bwd)
    return {"relation": rel.value, "fwd_ms": f_ms, "fwd_ms_min": min(fwd),
            "fwd_ms_max": max(fwd), "bwd_ms": b_ms, "bwd_ms_min": min(bwd),
            "bwd_ms_max": max(bwd), "fwd_tflops": flops / f_ms / 1e9,
            "bwd_tflops": 2.5 * flops / b_ms / 1e9,
            "total_tflops": 3.5 * flops / (f_ms + b_ms) / 1e9, "status": "ok"}


def _default_backends(device: torch.device) -> list[str]:
    """CPU: reference and cpu_flash. CUDA: the fast ones (the reference is the oracle of the
    correctness check already, and minutes per length at 64K+; name it to time it)."""
    names = available_backends()
    if device.type != "cuda":
        return [n for n in names if n in _CPU_DEFAULT]
    return [n for n in names if n not in ("cpu_flash", "reference")]


def _run_backend(name, seq_lens, params, check_len, repeats, warmup) -> list[dict]:
    base = {"backend": name}
    try:
        backend = get_backend(name)
    except BackendUnavailable as exc:
        return [{**base, "seq_len": s, "status": str(exc)} for s in seq_lens]
    try:
        err = check_correctness(backend, check_len, **params)
    except BackendUnavailable as exc:
        return [{**base, "seq_len": s, "status": str(exc)} for s in seq_lens]
    except RuntimeError as exc:  # a kernel error: report it and time the other backends
        status = f"failed its correctness run ({type(exc).__name__}: {exc})"
        return [{**base, "seq_len": s, "status": status} for s in seq_lens]
    correct = err <= TOLERANCE.get(params["dtype"], 4e-2)
    rows = []
    for seq_len in seq_lens:
        row = {**base, "seq_len": seq_len, "max_rel_err": err, "correct": correct}
        try:
            row.update(_measure(backend, seq_len, **params, repeats=repeats, warmup=warmup))
        except torch.cuda.OutOfMemoryError:
            row["status"] = f"out of memory at {seq_len} tokens"
        if params["device"].type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def run(seq_lens: list[int], backends: list[str] | None = None, heads: int = 32,
        head_dim: int = 128, dtype: torch.dtype | str = torch.bfloat16, causal: bool = True,
        documents: int | None = None, kv_heads: int | None = None, *, repeats: int = 5,
        warmup: int = 2, check_len: int = 256, device=None) -> BenchResult:
    """Benchmark the local attention backends (forward, backward, total TFLOP/s).

    Args:
        seq_lens: sequence lengths to time (batch 1).
        backends: backend names; None = every available fast one (CUDA: cudnn, flash,
            flash_attn, triton as installed; CPU: reference, cpu_flash).
        heads: query heads.
        head_dim: head dimension.
        dtype: input dtype, or its name ("bfloat16").
        causal: causal attention (else full).
        documents: pack this many equal documents per sequence (document mask), or None.
        kv_heads: key/value heads (GQA); None = ``heads``.
        repeats: timed runs per measurement (>= 5 for reported figures).
        warmup: untimed runs before timing.
        check_len: sequence length of the correctness check.
        device: where to run; default CUDA if available, else CPU.

    Returns:
        A :class:`BenchResult` with one row per (backend, seq_len); rows of backends that
        cannot run the request carry the reason in ``status``.

    Raises:
        ValueError: on impossible sizes (heads not divisible, too many documents, ...).
    """
    if isinstance(dtype, str):  # the CLI passes the name, e.g. "bfloat16"
        dtype = getattr(torch, dtype)
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}).")
    if not seq_lens or min(seq_lens) < 1 or repeats < 1:
        raise ValueError("give at least one positive sequence length and repeats >= 1.")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    check_len = min(check_len, min(seq_lens))
    doc_bounds(check_len, documents)  # validates documents early
    params = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  device=device, causal=causal, documents=documents)
    names = list(backends) if backends is not None else _default_backends(device)
    rows = []
    for name in names:
        rows += _run_backend(name, list(seq_lens), params, check_len, repeats, warmup)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "causal": causal,
            "documents": documents, "repeats": repeats, "warmup": warmup,
            "check_len": check_len, "flop_model": "fwd 4*H*D per visible pair (causal S^2/2); "
                                                  "bwd 2.5x fwd"}
    columns = ["backend", "seq_len", "relation", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops",
               "total_tflops", "max_rel_err", "correct", "status"]
    return BenchResult(title="attention kernels (single device)", rows=rows, meta=meta,
                       columns=columns, x="seq_len", y="total_tflops", series="backend")


__all__ = ["BenchResult", "run", "forward_flops", "doc_bounds", "check_correctness"]
