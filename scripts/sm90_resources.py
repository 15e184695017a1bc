#!/usr/bin/env python3
"""Registers, spill stack and shared memory of our Triton kernels compiled for sm_90a, on a CPU.

    python scripts/sm90_resources.py [fwd,dkdv,dq]     # ~1 minute per kernel on 2 cores

A developer tool, not part of the product. No GPU needed: Triton compiles for a given target
(``GPUTarget("cuda", 90, 32)``) and the cuobjdump shipped with Triton reads the cubin's
resource usage. Use it to see whether a kernel change or tile adds register pressure before
spending GPU time; then time the candidates with ``lctrain bench tiles`` on a GPU. Another
Triton version than the GPU machine's gives close, not equal, figures. bf16, head dim 128,
causal mask mode, each kernel with and without TMA.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what the GPU's Triton does; quiet
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lctrain_kernels.triton.backward import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel  # noqa: E402
from lctrain_kernels.triton.configs import DKDV_POINTS, DQ_POINTS, FWD_POINTS  # noqa: E402
from lctrain_kernels.triton.forward import attn_fwd_kernel  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
KERNELS = {"fwd": (attn_fwd_kernel, FWD_POINTS), "dkdv": (attn_bwd_dkdv_kernel, DKDV_POINTS),
           "dq": (attn_bwd_dq_kernel, DQ_POINTS)}
BF16 = {"Q", "K", "V", "DO", "DK", "DV", "DQ", "Out"}
FP32 = {"Lse", "Delta"}
INT32 = {"Q_LO", "Q_HI", "KV_LO", "KV_HI"}


def compile_sm90(fn, constexprs: dict, stages: int, warps: int):
    """``fn`` compiled for sm_90a with pointer args 16-byte aligned, as on the GPU."""
    sig = {}
    for arg in fn.arg_names:
        sig[arg] = ("constexpr" if arg in constexprs else "*bf16" if arg in BF16 else
                    "*fp32" if arg in FP32 else "*i32" if arg in INT32 else
                    "fp32" if arg == "sm_scale" else "i32")
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
               if sig[arg].startswith("*") or arg.startswith("stride")}
    return triton.compile(ASTSource(fn, sig, constexprs, aligned),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def resources(kernel) -> dict:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    text = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True,
                          check=True).stdout
    os.unlink(f.name)
    field = lambda key: int(re.search(rf"{key}:(\d+)", text).group(1))  # noqa: E731
    return {"registers": field("REG"), "stack_bytes": field("STACK"),
            "shared_bytes": kernel.metadata.shared}


def main() -> int:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(KERNELS)
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        sys.exit(f"unknown kernel {unknown[0]!r}; choose from {', '.join(KERNELS)}.")
    print(f"triton {triton.__version__}, sm_90a, bf16, head dim 128, causal")
    for name in names:
        fn, points = KERNELS[name]
        for tma in (False, True):
            for bm, bn, stages, warps in points[:-1]:  # the last point is the small fallback
                consts = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, MASK_MODE=1, UPCAST=False,
                              DOT_PREC="tf32", TMA=tma, BLOCK_M=bm, BLOCK_N=bn)
                if name == "fwd":
                    consts["WARP_SPECIALIZE"] = False
                res = resources(compile_sm90(fn, consts, stages, warps))
                print(f"{name:5} {'tma' if tma else 'ptr':4} {bm}x{bn} s{stages} w{warps}: "
                      f"{res['registers']} registers, {res['stack_bytes']} bytes stack, "
                      f"{res['shared_bytes']} bytes shared", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
