"""Tile sweeps of lctrain's Triton attention kernels: ``lctrain bench tiles``.

The autotuner only sees the few points of `lctrain_kernels.triton.configs`; this times a wider
set, one fixed configuration at a time, to decide what belongs in that list. A point is
``(BLOCK_M, BLOCK_N, num_stages, num_warps)`` — BLOCK_M runs over queries, BLOCK_N over keys —
written ``128x64s3w8``. For each sequence length:

* ``fwd`` points time the forward kernel alone;
* ``dkdv`` and ``dq`` points time the whole backward (delta and both kernels) with that kernel
  fixed and the other one autotuned, so a row is the backward a training step would run.

Every row is checked against the autotuned kernels on the same inputs (largest relative error
of out and lse, or of dq, dk, dv) and reported as TFLOP/s under `lctrain.model.flops`
(backward 2.5× the forward's FLOPs). A point that does not compile or does not fit (out of
shared memory or registers) gives a row with the reason. The first row of each kernel and
length is the autotuned one, the yardstick.
"""
from __future__ import annotations

import os
import re
from typing import Callable

import torch

from lctrain.model.flops import BACKWARD_FACTOR, MODEL, attention_flops
from lctrain.bench.result import BenchResult
from lctrain.bench.timing import measure
from lctrain.errors import ConfigError, UserError
from lctrain.report.versions import environment

KERNELS = ("fwd", "dkdv", "dq")
#: The default sweep of each kernel (wider than the autotune set).
SWEEP = {
    "fwd": [(128, 128, 3, 8), (128, 128, 2, 8), (128, 64, 3, 8), (128, 64, 4, 8), (128, 64, 5, 8),
            (64, 128, 3, 4), (64, 64, 4, 4), (256, 64, 2, 8), (256, 64, 3, 8), (256, 128, 2, 8)],
    "dkdv": [(64, 128, 3, 8), (64, 128, 2, 8), (64, 128, 4, 8), (32, 128, 3, 8), (32, 128, 4, 8),
             (32, 128, 3, 4), (32, 64, 3, 4), (32, 64, 4, 4), (32, 64, 5, 4), (64, 64, 3, 8),
             (16, 64, 4, 4), (16, 128, 4, 4)],
    "dq": [(128, 64, 3, 8), (128, 64, 4, 8), (128, 32, 3, 4), (128, 32, 4, 4), (128, 32, 3, 8),
           (64, 64, 3, 4), (64, 64, 4, 4), (128, 128, 2, 8), (64, 32, 4, 4)],
}
DEFAULTS = {"cuda": {"seq_lens": [16384, 65536], "heads": 32, "head_dim": 128, "dtype": "bfloat16"},
            "cpu": {"seq_lens": [128], "heads": 2, "head_dim": 32, "dtype": "float32"}}
_POINT = re.compile(r"^(\d+)x(\d+)s(\d+)w(\d+)$")


def parse_point(text: str) -> tuple[int, int, int, int]:
    """``"128x64s3w8"`` -> ``(128, 64, 3, 8)``.

    Raises:
        ConfigError: text not of that form.
    """
    match = _POINT.match(text.strip())
    if match is None:
        raise ConfigError(f"tile {text!r} is not BLOCK_MxBLOCK_NsSTAGESwWARPS; write e.g. 128x64s3w8")
    return tuple(int(g) for g in match.groups())  # type: ignore[return-value]


def label(point: tuple[int, int, int, int]) -> str:
    """``(128, 64, 3, 8)`` -> ``"128x64s3w8"``."""
    return "{}x{}s{}w{}".format(*point)


def _config(point) -> dict:
    bm, bn, stages, warps = point
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_stages": stages, "num_warps": warps}


def _rel(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _call(kernel: str, point, inputs, causal: bool):
    """The kernel call with ``point`` fixed (None: autotuned), returning what it computes."""
    from lctrain_kernels.triton import flash_backward, flash_forward

    q, k, v, do, out, lse = inputs
    config = None if point is None else _config(point)
    if kernel == "fwd":
        return lambda: flash_forward(q, k, v, causal=causal, config=config)
    key = "dkdv_config" if kernel == "dkdv" else "dq_config"
    return lambda: flash_backward(do, q, k, v, out, lse, causal=causal, **{key: config})


def _row(kernel, point, inputs, refs, flops, causal, device, repeats, warmup) -> dict:
    row = {"kernel": kernel, "config": "autotuned" if point is None else label(point)}
    call = _call(kernel, point, inputs, causal)
    try:
        got = call()
        row["max_rel_err"] = max(_rel(g, r) for g, r in zip(got, refs[kernel]))
        times = measure(call, None, device=device, repeats=repeats, warmup=warmup)
    except Exception as exc:  # noqa: BLE001 - a point that does not compile or fit is a result
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        row["status"] = f"{type(exc).__name__}: {first}"
        return row
    ms = times.summary()["fwd_ms"]  # the one timed call per iteration
    work = flops if kernel == "fwd" else BACKWARD_FACTOR * flops
    row.update(ms=ms, tflops=work / ms / 1e9, status="ok")
    return row


def run(seq_lens: list[int] | None = None, kernels: list[str] | None = None,
        points: list[tuple[int, int, int, int]] | None = None, heads: int | None = None,
        head_dim: int | None = None, dtype: torch.dtype | str | None = None,
        causal: bool = True, *, repeats: int = 5, warmup: int = 1, device=None,
        progress: Callable[[str], None] | None = None) -> BenchResult:
    """Time fixed tile configurations of lctrain's Triton kernels.

    Args:
        seq_lens: sequence lengths (batch 1); None = 16K and 64K on a GPU.
        kernels: which kernels to sweep (fwd, dkdv, dq); None = all three.
        points: the configurations to time for every kernel; None = ``SWEEP[kernel]``.
        heads, head_dim, dtype: the shape (None: 32 × 128, bf16 on a GPU).
        causal: causal attention.
        repeats, warmup: timed and untimed calls per point.
        device: where to run (default CUDA).
        progress: called with one line per timed point.

    Returns:
        A BenchResult of kind "tiles": per length and kernel, the autotuned row, then one row
        per point (``ms``, ``tflops``, ``max_rel_err``, ``status``).

    Raises:
        UserError: no CUDA GPU (and not under Triton's interpreter); ConfigError: an unknown
            kernel name.
    """
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if device is None:
        if not torch.cuda.is_available() and not interp:
            raise UserError("bench tiles times lctrain's Triton kernels and needs a CUDA GPU "
                            "(TRITON_INTERPRET=1 runs them, slowly, under Triton's interpreter)")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    base = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    kernels = list(kernels or KERNELS)
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ConfigError(f"unknown kernel {unknown[0]!r}; choose from {', '.join(KERNELS)}")
    heads, head_dim = heads or base["heads"], head_dim or base["head_dim"]
    dtype = dtype or base["dtype"]
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    say = progress or (lambda line: None)
    rows = []
    for seq_len in seq_lens or base["seq_lens"]:
        rows += _length(seq_len, kernels, points, heads, head_dim, dtype, causal, device,
                        repeats, warmup, say)
    meta = {"machine": environment(), "device": device.type, "heads": heads, "head_dim": head_dim,
            "dtype": str(dtype).replace("torch.", ""), "causal": causal, "repeats": repeats,
            "warmup": warmup, "flop_model": MODEL}
    return BenchResult(kind="tiles", title="Triton kernel tiles", rows=rows, meta=meta)


def _length(seq_len, kernels, points, heads, head_dim, dtype, causal, device, repeats, warmup,
            say) -> list[dict]:
    from lctrain_kernels.triton import flash_backward, flash_forward

    from lctrain.report.human import milliseconds, rate, tokens

    q, k, v, do = (torch.randn(1, seq_len, heads, head_dim, device=device, dtype=dtype)
                   for _ in range(4))  # (1, S, H, D)
    out, lse = flash_forward(q, k, v, causal=causal)
    grads = flash_backward(do, q, k, v, out, lse, causal=causal)
    inputs, refs = (q, k, v, do, out, lse), {"fwd": (out, lse), "dkdv": grads, "dq": grads}
    flops = attention_flops(seq_len, heads, head_dim, causal)
    rows = []
    for kernel in kernels:
        for point in [None, *(points or SWEEP[kernel])]:
            row = {"seq_len": seq_len, **_row(kernel, point, inputs, refs, flops, causal, device,
                                              repeats, warmup)}
            rows.append(row)
            what = f"{kernel} {row['config']} {tokens(seq_len)}:"
            say(f"{what} {milliseconds(row['ms'])}, {rate(row['tflops'])}, error "
                f"{row['max_rel_err']:.1e}" if row["status"] == "ok" else f"{what} {row['status']}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
