"""Rounding a float32 value in a Triton kernel to the dtype it is stored in, identically on the
GPU and in Triton's interpreter: the fused kernels (norms, RoPE, MLP, loss) compute in float32
and round once, and their CPU tests must see the GPU's rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The ``KIND`` constant `round_to` takes for each storage dtype."""


@triton.jit
def round_to(x, KIND: tl.constexpr):
    """float32 ``x`` rounded to the nearest value of float32 (KIND 0), bfloat16 (1) or float16
    (2), kept in float32. bfloat16 rounds by its bits: Triton's interpreter truncates a
    float32-to-bfloat16 cast, the GPU rounds to nearest even, this does the latter on both."""
    if KIND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    elif KIND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
