"""Single-device attention kernel benchmark: every local backend (and peer), side by side.

For each subject that can run the request (`lctrain.bench.kernel_subjects`): a correctness check
at a small length (out, lse and the three gradients against the float32 reference on the same
inputs), then at each length forward and backward timed by `lctrain.bench.timing.measure`, as
rates of the FLOP model of `lctrain.model.flops`; ``profile_dir`` adds a profile of each.

With ``documents`` (``--documents`` specs, `lctrain.bench.documents`) every sequence is packed
documents, each spec a mix of its own parsed at each length: rates count only the pairs inside
documents, each row carries its spec and mix, and the check runs the shortest length's mix
scaled to the check length. A dense reference (cuDNN on a GPU) is timed without documents, and
each document row gets ``of_dense``: its useful rate over the dense one. Without sizes the
defaults fit the device (Llama-7B's attention at 16K-64K in bf16 on a GPU; a small float32 case
on a CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from lctrain.bench.documents import Documents, parse_each
from lctrain.model.flops import MODEL, attention_flops, rates
from lctrain.bench.kernel_subjects import subject
from lctrain.bench.profile import profile
from lctrain.bench.result import BenchResult
from lctrain.bench.timing import measure
from lctrain.errors import ConfigError
from lctrain.report.versions import environment
from lctrain_kernels.api import (BackendUnavailable, MaskSpec, available_backends, classify,
                                 reference_backward, reference_forward)

#: largest relative error accepted by the correctness check, per dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
_CPU_DEFAULT = ("reference", "cpu_flash")  # triton on a CPU is the (slow) interpreter
_CPU_DOCUMENTS = ("reference",)  # cpu_flash refuses document masks
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
    """What every subject of one run is measured on."""

    seq_lens: list[int]
    params: dict  # heads, kv_heads, head_dim, dtype, device, causal
    mixes: list[_Mix]  # empty: one sequence, no documents
    check_len: int
    repeats: int
    warmup: int
    profile_dir: str | None
    say: Callable[[str], None]


def _inputs(seq_len, heads, kv_heads, head_dim, dtype, device):
    shape_q, shape_kv = (1, seq_len, heads, head_dim), (1, seq_len, kv_heads, head_dim)
    return (torch.randn(shape_q, dtype=dtype, device=device),  # (1, S, Hq, D)
            torch.randn(shape_kv, dtype=dtype, device=device),  # (1, S, Hkv, D)
            torch.randn(shape_kv, dtype=dtype, device=device),
            torch.randn(shape_q, dtype=dtype, device=device))  # dO


def _setup(what, seq_len, heads, kv_heads, head_dim, dtype, device, causal, bounds):
    """(inputs, spec, relation, scale, closures or the reason it cannot run)."""
    q, k, v, do = _inputs(seq_len, heads, kv_heads, head_dim, dtype, device)
    spec = MaskSpec(causal, doc_bounds=bounds)
    rel, scale = classify(spec, seq_len, seq_len), head_dim ** -0.5
    reason = what.unsupported(q, k, v, spec, rel)
    closures = None if reason else what.closures(q, k, v, do, spec, rel, scale)
    return (q, k, v, do), spec, rel, scale, closures or reason


def check_correctness(what, seq_len, heads, kv_heads, head_dim, dtype, device, causal,
                      bounds=None) -> float:
    """Worst relative error of out, lse, dq, dk, dv against the float32 reference, of a subject
    (`lctrain.bench.kernel_subjects.subject`) or a bare backend, with document ``bounds``.

    Raises:
        BackendUnavailable: it cannot run this request (with its reason).
    """
    if not hasattr(what, "closures"):
        what = subject(what.name)
    inputs, spec, _, scale, made = _setup(what, seq_len, heads, kv_heads, head_dim, dtype,
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
    errors = []
    for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        diff = (got.to(wide) - want).abs().max()
        errors.append((diff / want.abs().max().clamp_min(1e-30)).item())
    return max(errors)


def _measure(what, seq_len, params, bounds, repeats, warmup, trace) -> dict:
    _, spec, rel, _, made = _setup(what, seq_len, **params, bounds=bounds)
    if isinstance(made, str):
        return {"relation": rel.value, "status": made}
    fwd, bwd = made
    times = measure(fwd, bwd, device=params["device"], repeats=repeats, warmup=warmup)
    row = {"relation": rel.value, **times.summary(),
           "fwd_ms_min": min(times.fwd), "fwd_ms_max": max(times.fwd),
           "bwd_ms_min": min(times.bwd), "bwd_ms_max": max(times.bwd)}
    flops = attention_flops(seq_len, params["heads"], params["head_dim"], params["causal"],
                            spec.doc_bounds)  # useful FLOPs: only the pairs inside documents
    row.update(rates(flops, row["fwd_ms"], row["bwd_ms"]), status="ok")
    if trace is not None:
        row.update(profile(fwd, bwd, params["device"], trace))
    return row


def default_backends(device: torch.device, documents: bool = False) -> list[str]:
    """CPU: reference and cpu_flash (reference alone with documents); CUDA: the fast ones (the
    reference takes minutes per length at 64K+; name it to time it)."""
    names = available_backends()
    if device.type != "cuda":
        return [n for n in names if n in (_CPU_DOCUMENTS if documents else _CPU_DEFAULT)]
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
        what = subject(name)
        err = check_correctness(what, plan.check_len, **plan.params,
                                bounds=None if mix is None else mix.check.cu_seqlens)
    except BackendUnavailable as exc:
        plan.say(f"{head}: {exc}")
        return [{**base, "seq_len": s, "status": str(exc)} for s in plan.seq_lens]
    except RuntimeError as exc:  # a kernel error: report it and time the other backends
        status = f"failed its correctness run ({type(exc).__name__}: {str(exc).splitlines()[0]})"
        plan.say(f"{head}: {status}")
        return [{**base, "seq_len": s, "status": status} for s in plan.seq_lens]
    correct = err <= TOLERANCE.get(plan.params["dtype"], 4e-2)
    plan.say(f"{head}: error {err:.1e} against float32 math at {plan.check_len} "
             f"tokens{'' if correct else ' — ABOVE the tolerance'}")
    rows = []
    for seq_len in plan.seq_lens:
        row = {**base, "seq_len": seq_len, "max_rel_err": err, "correct": correct}
        bounds = None if mix is None else mix.at[seq_len].cu_seqlens
        if mix is not None:
            row["mix"] = mix.at[seq_len].summary()
        trace = None
        if plan.profile_dir is not None:
            slug = name if not plan.mixes else f"{name}-dense" if mix is None else \
                f"{name}-mix{mix.index}"
            trace = Path(plan.profile_dir) / f"kernel-{slug}-{seq_len}.json"
        try:
            row.update(_measure(what, seq_len, plan.params, bounds, plan.repeats, plan.warmup,
                                trace))
        except torch.cuda.OutOfMemoryError:
            row["status"] = f"out of memory at {seq_len} tokens"
        if plan.params["device"].type == "cuda":
            torch.cuda.empty_cache()
        row.update(_of_dense(row, (dense or {}).get(seq_len)))
        plan.say(_progress_line(row))
        rows.append(row)
    return rows


def _of_dense(row: dict, dense: dict | None) -> dict:
    """``of_dense`` (fwd+bwd), ``of_dense_fwd`` and ``of_dense_bwd``: the row's useful rates over
    the dense reference's at the same length, where both were measured."""
    if dense is None or row.get("status") != "ok" or dense.get("status") != "ok":
        return {}
    return {key: row[rate] / dense[rate] for key, rate in (
        ("of_dense", "total_tflops"), ("of_dense_fwd", "fwd_tflops"),
        ("of_dense_bwd", "bwd_tflops")) if row.get(rate) and dense.get(rate)}


def _progress_line(row: dict) -> str:
    from lctrain.report.human import milliseconds, percent, rate, tokens

    spec = f" {row['documents']}" if row.get("documents") else ""
    head = f"{row['backend']}{spec} {tokens(row['seq_len'])}:"
    if row.get("status") != "ok":
        return f"{head} {row.get('status')}"
    text = (f"{head} fwd {milliseconds(row['fwd_ms'])}, bwd {milliseconds(row['bwd_ms'])}, "
            f"{rate(row['total_tflops'])} fwd+bwd")
    return text + (f", {percent(row['of_dense'])} of dense" if row.get("of_dense") else "")


def run(seq_lens: list[int] | None = None, backends: list[str] | None = None,
        heads: int | None = None, head_dim: int | None = None,
        dtype: torch.dtype | str | None = None, causal: bool = True,
        documents: str | int | Sequence[str | int] | Mapping[int, Documents] | None = None,
        kv_heads: int | None = None, *, recipe=None, dense_reference: str | None = "auto",
        repeats: int = 5, warmup: int = 2, check_len: int | None = None, device=None,
        profile_dir: str | None = None,
        progress: Callable[[str], None] | None = None) -> BenchResult:
    """Benchmark the local attention backends (forward, backward, total TFLOP/s).

    Args:
        seq_lens: sequence lengths to time (batch 1); None = the device's defaults.
        backends: backend or peer names; None = the available fast backends (CUDA: cudnn,
            triton, cudnn_ragged, flash_attn_cute as installed; CPU: reference and cpu_flash,
            or reference alone with documents).
        heads, head_dim, dtype, kv_heads: the shape and dtype (or its name); None: the
            device's defaults (``DEFAULTS``; kv_heads = heads).
        causal: causal attention (else full).
        documents: a ``--documents`` spec (an int N: N equal documents) or several, each a mix
            of its own; or one mix already parsed per length; None: one sequence.
        recipe: the recipe whose tokenizer reads a ``data:FILE`` spec.
        dense_reference: with documents, the backend timed without them, the denominator of
            ``of_dense``: "auto" = cudnn on a GPU (none on a CPU); None or "none": none.
        repeats, warmup: timed and untimed runs per measurement.
        check_len: length of the correctness check (default the device's, at most the
            shortest length).
        device: default CUDA if available, else CPU.
        profile_dir: also profile each measurement; chrome traces go here.
        progress: called with one line per step while running.

    Returns:
        A :class:`BenchResult` of kind "kernel", one row per (backend, seq_len[, mix]), the
        dense reference's first ("NAME (dense)"); rows that cannot run say why in ``status``.

    Raises:
        ConfigError: impossible sizes (heads not divisible, a bad documents spec, ...).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan, names, dense = _plan(seq_lens, backends, heads, head_dim, dtype, causal, documents,
                               kv_heads, recipe, dense_reference, repeats, warmup, check_len,
                               device, profile_dir, progress)
    rows = []
    if dense is not None:
        rows += _run_subject(plan, dense, None, label=f"{dense} (dense)")
    dense_rows = {row["seq_len"]: row for row in rows}
    for mix in plan.mixes or [None]:
        for name in names:
            rows += _run_subject(plan, name, mix, dense=dense_rows)
    p = plan.params
    meta = {"machine": environment(), "dtype": str(p["dtype"]).replace("torch.", ""),
            "heads": p["heads"], "kv_heads": p["kv_heads"], "head_dim": p["head_dim"],
            "causal": causal, "repeats": repeats, "warmup": warmup,
            "check_len": plan.check_len, "device": device.type, "flop_model": MODEL}
    if plan.mixes:
        meta.update(documents=[mix.spec for mix in plan.mixes], dense_reference=dense,
                    check_documents=[mix.check.summary() for mix in plan.mixes])
    return BenchResult(kind="kernel", title="attention kernels, one device", rows=rows,
                       meta=meta)


def _plan(seq_lens, backends, heads, head_dim, dtype, causal, documents, kv_heads, recipe,
          dense_reference, repeats, warmup, check_len, device, profile_dir, progress):
    """(plan, backend names, dense reference or None) of a run, checked; see :func:`run`."""
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
    return plan, names, dense


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


__all__ = ["DEFAULTS", "TOLERANCE", "check_correctness", "default_backends", "run"]
