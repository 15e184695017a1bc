"""Single-device attention kernel benchmark: every local backend, side by side.

Each backend is checked at a small length against the float32 reference, then timed
at each length as rates of `lctrain.model.flops`. With ``documents`` every sequence is packed
documents, each spec a mix: rates count only the pairs inside documents, and each row gets
``of_dense``, its useful rate over that of a dense reference (cuDNN on a GPU)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from lctrain.bench.documents import Documents, parse_each
from lctrain.model.flops import MODEL, attention_flops, rates
from lctrain.bench.result import BenchResult
from lctrain.bench.timing import measure, profile
from lctrain.bench.views import progress_line
from lctrain.config.fields import suggest
from lctrain.errors import ConfigError
from lctrain.report.versions import environment
from lctrain_kernels.api import (BackendUnavailable, MaskSpec, available_backends, classify,
                                 get_backend, reference_backward, reference_forward)
from lctrain_kernels.vocabulary import BACKENDS


#: largest relative error accepted by the correctness check, per dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
DEFAULTS = {  # per device type: what a run with no sizes measures
    "cuda": {"seq_lens": [16384, 32768, 65536], "heads": 32, "head_dim": 128,
             "dtype": "bfloat16", "check_len": 4096},
    "cpu": {"seq_lens": [256, 512, 1024], "heads": 8, "head_dim": 64, "dtype": "float32",
            "check_len": 256},
}


@dataclass(frozen=True)
class _Mix:
    """One ``--documents`` spec: its documents at each length and at the check length."""

    index: int
    spec: str
    at: Mapping[int, Documents]
    check: Documents


@dataclass(frozen=True)
class _Plan:
    """What every backend of one run is measured on."""

    seq_lens: list[int]
    params: dict  # heads, kv_heads, head_dim, dtype, device, causal
    mixes: list[_Mix]  # empty: one sequence, no documents
    check_len: int
    repeats: int
    warmup: int
    profile_dir: str | None
    say: Callable[[str], None]


def _setup(backend, seq_len, heads, kv_heads, head_dim, dtype, device, causal, bounds):
    """(inputs, spec, relation, scale, closures or the reason it cannot run). The closures are
    ``fwd() -> (out, lse)`` and ``bwd(state) -> (dq, dk, dv)``, the backward from one forward's
    out and lse, as training calls it."""
    shapes = [(1, seq_len, h, head_dim) for h in (heads, kv_heads, kv_heads, heads)]
    q, k, v, do = (torch.randn(s, dtype=dtype, device=device) for s in shapes)  # (1, S, H, D)
    spec = MaskSpec(causal, doc_bounds=bounds)
    rel, scale = classify(spec, seq_len, seq_len), head_dim ** -0.5
    reason = backend.unsupported(q, k, v, spec, rel)
    if reason:
        return (q, k, v, do), spec, rel, scale, reason
    out, lse = backend.forward(q, k, v, spec, rel, scale)
    return (q, k, v, do), spec, rel, scale, (
        lambda: backend.forward(q, k, v, spec, rel, scale),
        lambda _state: backend.backward(do, q, k, v, out, lse, spec, rel, scale))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error of ``got`` over the largest magnitude of ``want``."""
    return float((got.to(want.dtype) - want).abs().max() / want.abs().max().clamp_min(1e-30))


def check_correctness(backend, seq_len, heads, kv_heads, head_dim, dtype, device, causal,
                      bounds=None) -> float:
    """Worst relative error of out, lse, dq, dk, dv of a backend (`get_backend`) against the
    float32 reference; BackendUnavailable (with its reason) when it cannot run."""
    inputs, spec, _, scale, made = _setup(backend, seq_len, heads, kv_heads, head_dim, dtype,
                                          device, causal, bounds)
    if isinstance(made, str):
        raise BackendUnavailable(made)
    fwd, bwd = made
    out, lse = fwd()
    grads = bwd((out, lse))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, do = (x.to(wide) for x in inputs)
    ref_out, ref_lse = reference_forward(q, k, v, spec, scale)
    ref_grads = reference_backward(do, q, k, v, ref_out, ref_lse, spec, scale)
    return max(map(relative_error, (out, lse, *grads), (ref_out, ref_lse, *ref_grads)))


def _measure(backend, seq_len, params, bounds, repeats, warmup, trace) -> dict:
    *_, rel, _, made = _setup(backend, seq_len, **params, bounds=bounds)
    if isinstance(made, str):
        return {"relation": rel.value, "status": made}
    fwd, bwd = made
    times = measure(fwd, bwd, device=params["device"], repeats=repeats, warmup=warmup)
    row = {"relation": rel.value, **times.summary()}
    flops = attention_flops(seq_len, params["heads"], params["head_dim"], params["causal"],
                            bounds)  # useful FLOPs: only the pairs inside documents
    row.update(rates(flops, row["fwd_ms"], row["bwd_ms"]), status="ok")
    if trace is not None:
        row.update(profile(fwd, bwd, params["device"], trace))
    return row


def default_backends(device: torch.device, documents: bool = False) -> list[str]:
    """CPU: reference and cpu_flash (reference alone with documents); CUDA: the fast ones."""
    names = available_backends()
    if device.type != "cuda":  # not triton, the (slow) interpreter; cpu_flash refuses documents
        return [n for n in names if n == "reference" or (n == "cpu_flash" and not documents)]
    return [n for n in names if n not in ("cpu_flash", "reference")]


def _run_subject(plan: _Plan, name: str, mix: _Mix | None, dense: dict | None = None,
                 label: str | None = None) -> list[dict]:
    """Check, then time ``name`` at every length, packed as ``mix`` (None: one sequence);
    ``dense``: the dense reference's row per length; ``label`` names the rows."""
    base = {"backend": label or name}
    if plan.mixes:  # rows of a documents run say which mix they ran (None: the dense reference)
        base["documents"] = None if mix is None else mix.spec
    head = base["backend"] + ("" if mix is None else f" {mix.spec}")
    try:
        backend = get_backend(name)  # BackendUnavailable: unknown or not installed
        err = check_correctness(backend, plan.check_len, **plan.params,
                                bounds=None if mix is None else mix.check.cu_seqlens)
    except RuntimeError as exc:  # unavailable, or a kernel error: time the other backends
        status = str(exc) if isinstance(exc, BackendUnavailable) else \
            f"failed its correctness run ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        plan.say(f"{head}: {status}")
        return [{**base, "seq_len": s, "status": status} for s in plan.seq_lens]
    correct = err <= TOLERANCE.get(plan.params["dtype"], 4e-2)
    plan.say(f"{head}: error {err:.1e} against float32 math at {plan.check_len} "
             f"tokens{'' if correct else ' — ABOVE the tolerance'}")
    slug = name if not plan.mixes else f"{name}-dense" if mix is None else f"{name}-mix{mix.index}"
    rows = []
    for seq_len in plan.seq_lens:
        row = {**base, "seq_len": seq_len, "max_rel_err": err, "correct": correct}
        bounds = None if mix is None else mix.at[seq_len].cu_seqlens
        if mix is not None:
            row["mix"] = mix.at[seq_len].summary()
        trace = None if plan.profile_dir is None else \
            Path(plan.profile_dir) / f"kernel-{slug}-{seq_len}.json"
        try:
            row.update(_measure(backend, seq_len, plan.params, bounds, plan.repeats, plan.warmup,
                                trace))
        except torch.cuda.OutOfMemoryError:
            row["status"] = f"out of memory at {seq_len} tokens"
        torch.cuda.empty_cache()  # a no-op where CUDA was never used
        ref = (dense or {}).get(seq_len)  # rates over the dense row's: fwd+bwd, fwd, bwd
        if ref is not None and row.get("status") == "ok" and ref.get("status") == "ok":
            row.update({key: row[rate] / ref[rate] for key, rate in (
                ("of_dense", "total_tflops"), ("of_dense_fwd", "fwd_tflops"),
                ("of_dense_bwd", "bwd_tflops")) if row.get(rate) and ref.get(rate)})
        plan.say(progress_line(row))
        rows.append(row)
    return rows


def run(seq_lens: list[int] | None = None, backends: list[str] | None = None,
        heads: int | None = None, head_dim: int | None = None,
        dtype: torch.dtype | str | None = None, causal: bool = True,
        documents: str | int | Sequence[str | int] | Mapping[int, Documents] | None = None,
        kv_heads: int | None = None, *, recipe=None, dense_reference: str | None = "auto",
        repeats: int = 5, warmup: int = 2, check_len: int | None = None, device=None,
        profile_dir: str | None = None,
        progress: Callable[[str], None] | None = None) -> BenchResult:
    """Benchmark the local attention backends: a result of kind "kernel", one row per (backend,
    seq_len[, mix]), the dense reference's first; None picks the device's defaults.
    ``documents``: a ``--documents`` spec, several (a mix each), or one mix parsed per length
    (``recipe`` reads a ``data:FILE`` spec); ``dense_reference`` ("auto": cudnn on a GPU, none on
    a CPU) is the denominator of ``of_dense``. ConfigError: impossible sizes or specs."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    seq_lens = list(seq_lens or base["seq_lens"])
    heads, head_dim = heads or base["heads"], head_dim or base["head_dim"]
    dtype = getattr(torch, str(dtype or base["dtype"]).replace("torch.", ""))  # a name or a dtype
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ConfigError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    if min(seq_lens) < 1 or repeats < 1:
        raise ConfigError("give positive sequence lengths and at least 1 repeat")
    check_len = min(check_len or base["check_len"], min(seq_lens))
    mixes = _mixes(documents, seq_lens, check_len, recipe)
    if not mixes and dense_reference not in (None, "none", "auto"):
        raise ConfigError(f"--dense-reference {dense_reference} is the dense rate packed "
                          f"documents are compared with; add --documents SPEC, or leave it out")
    dense = None if dense_reference in (None, "none") or not mixes else dense_reference
    if dense == "auto":
        dense = "cudnn" if device.type == "cuda" else None
    params = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  device=device, causal=causal)
    plan = _Plan(seq_lens, params, mixes, check_len, repeats, warmup, profile_dir,
                 progress or (lambda line: None))
    names = list(backends) if backends else default_backends(device, bool(mixes))
    for option, name in [*(("--backend", n) for n in names), ("--dense-reference", dense)]:
        if name is not None and name not in BACKENDS:  # a typo, not a backend missing here
            raise ConfigError(f"{option} {name!r} is not an attention backend; choose from "
                              f"{', '.join(BACKENDS)}{suggest(name, BACKENDS)}")
    rows = []
    if dense is not None:
        rows += _run_subject(plan, dense, None, label=f"{dense} (dense)")
    dense_rows = {row["seq_len"]: row for row in rows}
    for mix in mixes or [None]:
        for name in names:
            rows += _run_subject(plan, name, mix, dense=dense_rows)
    meta = {"machine": environment(), "dtype": str(dtype).replace("torch.", ""),
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "causal": causal,
            "repeats": repeats, "warmup": warmup, "check_len": check_len,
            "device": device.type, "flop_model": MODEL}
    if mixes:
        meta.update(documents=[mix.spec for mix in mixes], dense_reference=dense,
                    check_documents=[mix.check.summary() for mix in mixes])
    return BenchResult(kind="kernel", title="attention kernels, one device", rows=rows, meta=meta)


def _mixes(documents, seq_lens: list[int], check_len: int, recipe) -> list[_Mix]:
    """Every mix of ``documents`` (see :func:`run`), parsed at every length."""
    if documents is None:
        return []
    if isinstance(documents, Mapping):
        parsed = [dict(documents)]
    else:
        specs = [documents] if isinstance(documents, (str, int)) else list(documents)
        parsed = [parse_each(spec, seq_lens, recipe=recipe) for spec in specs]
    short = min(seq_lens)
    return [_Mix(i, at[short].spec, at, at[short].scaled(check_len))
            for i, at in enumerate(parsed, 1)]
