"""Single-device attention kernel benchmark: every local backend (and peer), side by side.

For each subject that can run the request (`lctrain.bench.kernel_subjects`), first a
correctness check at a small length (forward, lse and all three gradients against the float32
reference on the same inputs, upcast), then at each sequence length the forward and backward
timed by `lctrain.bench.timing.measure` (warm-up, then the median of ``repeats``), as rates
under the FLOP model of `lctrain.bench.flops`. With ``profile_dir`` a few more iterations run
under the profiler (`lctrain.bench.profile`).

With no sizes given, the defaults fit the device: Llama-7B's attention (32 heads of 128) at
16K-64K in bf16 on a GPU; 8 heads of 64 at 256-1K tokens in float32 on a CPU, which finishes
in seconds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from lctrain.bench.flops import MODEL, attention_flops, rates
from lctrain.bench.kernel_subjects import subject
from lctrain.bench.profile import profile
from lctrain.bench.result import BenchResult
from lctrain.bench.timing import measure
from lctrain.errors import ConfigError
from lctrain.report.versions import environment
from lctrain_kernels.backends import BackendUnavailable, available_backends
from lctrain_kernels.masks import MaskSpec, classify
from lctrain_kernels.reference import reference_backward, reference_forward

#: largest relative error accepted by the correctness check, per dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
_CPU_DEFAULT = ("reference", "cpu_flash")  # triton on a CPU is the (slow) interpreter
DEFAULTS = {  # per device type: what a run with no sizes measures
    "cuda": {"seq_lens": [16384, 32768, 65536], "heads": 32, "head_dim": 128,
             "dtype": "bfloat16", "check_len": 4096},
    "cpu": {"seq_lens": [256, 512, 1024], "heads": 8, "head_dim": 64, "dtype": "float32",
            "check_len": 256},
}


def doc_bounds(seq_len: int, documents: int | None) -> tuple[int, ...] | None:
    """Boundaries of ``documents`` packed documents of (nearly) equal length."""
    if not documents:
        return None
    if not 1 <= documents <= seq_len:
        raise ConfigError(f"--documents must be between 1 and the sequence length {seq_len}, "
                        f"got {documents}")
    return tuple(round(i * seq_len / documents) for i in range(documents + 1))


def _inputs(seq_len, heads, kv_heads, head_dim, dtype, device):
    shape_q, shape_kv = (1, seq_len, heads, head_dim), (1, seq_len, kv_heads, head_dim)
    return (torch.randn(shape_q, dtype=dtype, device=device),  # (1, S, Hq, D)
            torch.randn(shape_kv, dtype=dtype, device=device),  # (1, S, Hkv, D)
            torch.randn(shape_kv, dtype=dtype, device=device),
            torch.randn(shape_q, dtype=dtype, device=device))  # dO


def _setup(what, seq_len, heads, kv_heads, head_dim, dtype, device, causal, documents):
    """(inputs, spec, relation, scale, closures or the reason it cannot run)."""
    q, k, v, do = _inputs(seq_len, heads, kv_heads, head_dim, dtype, device)
    spec = MaskSpec(causal, doc_bounds=doc_bounds(seq_len, documents))
    rel, scale = classify(spec, seq_len, seq_len), head_dim ** -0.5
    reason = what.unsupported(q, k, v, spec, rel)
    closures = None if reason else what.closures(q, k, v, do, spec, rel, scale)
    return (q, k, v, do), spec, rel, scale, closures or reason


def check_correctness(what, seq_len, heads, kv_heads, head_dim, dtype, device, causal,
                      documents) -> float:
    """Worst relative error of out, lse, dq, dk, dv against the float32 reference.

    Args:
        what: a subject (`lctrain.bench.kernel_subjects.subject`) or a bare backend.

    Raises:
        BackendUnavailable: if it cannot run this request (with its reason).
    """
    if not hasattr(what, "closures"):
        what = subject(what.name)
    inputs, spec, _, scale, made = _setup(what, seq_len, heads, kv_heads, head_dim, dtype,
                                          device, causal, documents)
    if isinstance(made, str):
        raise BackendUnavailable(made)
    fwd, bwd = made
    out, lse = fwd()
    grads = bwd((out, lse))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, do = (x.to(wide) for x in inputs)
    ref_out, ref_lse = reference_forward(q, k, v, spec, scale)
    ref_grads = reference_backward(do, q, k, v, ref_out, ref_lse, spec, scale)
    errors = []
    for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        diff = (got.to(wide) - want).abs().max()
        errors.append((diff / want.abs().max().clamp_min(1e-30)).item())
    return max(errors)


def _measure(what, seq_len, params, repeats, warmup, trace) -> dict:
    _, spec, rel, _, made = _setup(what, seq_len, **params)
    if isinstance(made, str):
        return {"relation": rel.value, "status": made}
    fwd, bwd = made
    times = measure(fwd, bwd, device=params["device"], repeats=repeats, warmup=warmup)
    row = {"relation": rel.value, **times.summary(),
           "fwd_ms_min": min(times.fwd), "fwd_ms_max": max(times.fwd),
           "bwd_ms_min": min(times.bwd), "bwd_ms_max": max(times.bwd)}
    flops = attention_flops(seq_len, params["heads"], params["head_dim"], params["causal"],
                            spec.doc_bounds)
    row.update(rates(flops, row["fwd_ms"], row["bwd_ms"]), status="ok")
    if trace is not None:
        row.update(profile(fwd, bwd, params["device"], trace))
    return row


def default_backends(device: torch.device) -> list[str]:
    """CPU: reference and cpu_flash. CUDA: the fast ones (the reference is the oracle of the
    correctness check already, and minutes per length at 64K+; name it to time it)."""
    names = available_backends()
    if device.type != "cuda":
        return [n for n in names if n in _CPU_DEFAULT]
    return [n for n in names if n not in ("cpu_flash", "reference")]


def _run_subject(name, seq_lens, params, check_len, repeats, warmup, profile_dir, say) -> list[dict]:
    base = {"backend": name}
    try:
        what = subject(name)
        err = check_correctness(what, check_len, **params)
    except BackendUnavailable as exc:
        say(f"{name}: {exc}")
        return [{**base, "seq_len": s, "status": str(exc)} for s in seq_lens]
    except RuntimeError as exc:  # a kernel error: report it and time the other backends
        status = f"failed its correctness run ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        say(f"{name}: {status}")
        return [{**base, "seq_len": s, "status": status} for s in seq_lens]
    correct = err <= TOLERANCE.get(params["dtype"], 4e-2)
    say(f"{name}: error {err:.1e} against float32 math at {check_len} tokens"
        f"{'' if correct else ' — ABOVE the tolerance'}")
    rows = []
    for seq_len in seq_lens:
        row = {**base, "seq_len": seq_len, "max_rel_err": err, "correct": correct}
        trace = None if profile_dir is None else Path(profile_dir) / f"kernel-{name}-{seq_len}.json"
        try:
            row.update(_measure(what, seq_len, params, repeats, warmup, trace))
        except torch.cuda.OutOfMemoryError:
            row["status"] = f"out of memory at {seq_len} tokens"
        if params["device"].type == "cuda":
            torch.cuda.empty_cache()
        say(_progress_line(row))
        rows.append(row)
    return rows


def _progress_line(row: dict) -> str:
    from lctrain.report.human import milliseconds, rate, tokens

    head = f"{row['backend']} {tokens(row['seq_len'])}:"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')}"
    return (f"{head} fwd {milliseconds(row['fwd_ms'])}, bwd {milliseconds(row['bwd_ms'])}, "
            f"{rate(row['total_tflops'])} fwd+bwd")


def run(seq_lens: list[int] | None = None, backends: list[str] | None = None,
        heads: int | None = None, head_dim: int | None = None,
        dtype: torch.dtype | str | None = None, causal: bool = True,
        documents: int | None = None, kv_heads: int | None = None, *, repeats: int = 5,
        warmup: int = 2, check_len: int | None = None, device=None,
        profile_dir: str | None = None,
        progress: Callable[[str], None] | None = None) -> BenchResult:
    """Benchmark the local attention backends (forward, backward, total TFLOP/s).

    Args:
        seq_lens: sequence lengths to time (batch 1); None = the device's defaults.
        backends: backend or peer names; None = every available fast backend (CUDA: cudnn,
            flash, flash_attn, triton as installed; CPU: reference, cpu_flash).
        heads, head_dim, dtype: the shape and input dtype (or its name); None = the
            device's defaults (``DEFAULTS``).
        causal: causal attention (else full).
        documents: pack this many equal documents per sequence (document mask), or None.
        kv_heads: key/value heads (GQA); None = ``heads``.
        repeats: timed runs per measurement (>= 5 for reported figures).
        warmup: untimed runs before timing.
        check_len: sequence length of the correctness check (default: the device's, at most
            the shortest length).
        device: where to run; default CUDA if available, else CPU.
        profile_dir: also profile each measurement; chrome traces go here.
        progress: called with one line per step (check, measurement) while running.

    Returns:
        A :class:`BenchResult` of kind "kernel", one row per (backend, seq_len); rows of
        backends that cannot run the request carry the reason in ``status``.

    Raises:
        ConfigError: impossible sizes (heads not divisible, too many documents, ...).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    seq_lens = list(seq_lens or base["seq_lens"])
    heads, head_dim = heads or base["heads"], head_dim or base["head_dim"]
    dtype = dtype or base["dtype"]
    if isinstance(dtype, str):  # the CLI passes the name, e.g. "bfloat16"
        dtype = getattr(torch, dtype)
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ConfigError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    if min(seq_lens) < 1 or repeats < 1:
        raise ConfigError("give positive sequence lengths and at least 1 repeat")
    check_len = min(check_len or base["check_len"], min(seq_lens))
    doc_bounds(check_len, documents)  # validates documents early
    params = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  device=device, causal=causal, documents=documents)
    names = list(backends) if backends else default_backends(device)
    say = progress or (lambda line: None)
    rows = []
    for name in names:
        rows += _run_subject(name, seq_lens, params, check_len, repeats, warmup, profile_dir, say)
    meta = {"machine": environment(), "dtype": str(dtype).replace("torch.", ""), "heads": heads,
            "kv_heads": kv_heads, "head_dim": head_dim, "causal": causal, "documents": documents,
            "repeats": repeats, "warmup": warmup, "check_len": check_len, "device": device.type,
            "flop_model": MODEL}
    return BenchResult(kind="kernel", title="attention kernels, one device", rows=rows,
                       meta=meta)


__all__ = ["DEFAULTS", "TOLERANCE", "check_correctness", "default_backends", "doc_bounds", "run"]
