"""Tile configurations: a small autotune set per kernel, pruning, and the interpreter's tiles.

Each kernel is tuned over a few (BLOCK_M, BLOCK_N, num_stages, num_warps) points around the shapes
known to run well on Hopper (Triton's fused-attention tutorial, torch's flex_attention defaults).
:func:`prune` drops, before compiling, the points whose pipelined tiles cannot fit the device's
shared memory or whose accumulators would spill. The autotune key is (HEAD_DIM_PAD, MASK_MODE,
SEQ_BUCKET, TMA) and the dtypes, SEQ_BUCKET capped at 16K: every long sequence shares one tuning.
Under the interpreter one small tile runs (several tiles per test)."""
from __future__ import annotations

import torch
import triton

#: (BLOCK_M, BLOCK_N, num_stages, num_warps), BLOCK_M over queries; the last point of each list
#: is a fallback, tuned only when no larger one fits.
FWD_POINTS = [(128, 128, 3, 8), (128, 64, 3, 8), (128, 128, 2, 8), (64, 64, 3, 4), (64, 64, 2, 4)]
DKDV_POINTS = [(64, 128, 3, 8), (32, 128, 3, 8), (32, 128, 2, 8), (32, 64, 3, 4), (32, 64, 2, 4)]
DQ_POINTS = [(128, 64, 3, 8), (128, 64, 2, 8), (64, 64, 3, 4), (64, 32, 2, 4)]
# float32 inputs run tf32x3 products, which split every operand in two: smaller tiles.
FP32_POINTS = {"fwd": [(64, 32, 2, 4), (32, 32, 2, 4)], "dkdv": [(32, 32, 2, 4)],
               "dq": [(32, 32, 2, 4)]}
# Launched when a tuned configuration still runs out of shared memory on some GPU.
SAFE_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1, "num_warps": 4}

INTERPRET_CONFIGS = {  # fixed tiles under TRITON_INTERPRET (no autotuning there)
    "fwd": {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1, "num_warps": 4},
    "dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_stages": 1, "num_warps": 4},
    "dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1, "num_warps": 4},
}

SEQ_BUCKET_CAP = 16384
_REGS_PER_THREAD = 192  # float32 accumulator budget per thread before we expect spills


def seq_bucket(sq: int, sk: int) -> int:
    """The autotune bucket of a (sq, sk) block."""
    return min(triton.next_power_of_2(max(sq, sk)), SEQ_BUCKET_CAP)


def make_configs(points) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_stages=s, num_warps=w)
            for bm, bn, s, w in points]


def _max_shared_memory() -> int:
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(
            torch.cuda.current_device())
        return int(props["max_shared_mem"])
    except Exception:  # noqa: BLE001 - unknown driver: assume an Ampere-class limit
        return 166 * 1024


def _footprint(kind: str, bm: int, bn: int, stages: int, d: int, elt: int) -> tuple[int, int]:
    """(shared-memory bytes, float32 accumulator elements) of one program."""
    if kind == "fwd":  # q resident; k, v tiles pipelined; acc (bm, d) and scores (bm, bn)
        return (bm * d + stages * 2 * bn * d) * elt, bm * d + bm * bn
    if kind == "dq":  # q, do resident; k, v pipelined; dq (bm, d) and two (bm, bn) tiles
        return (2 * bm * d + stages * 2 * bn * d) * elt, bm * d + 2 * bm * bn
    # dkdv: k, v resident; q, do pipelined; dk, dv (bn, d) and two (bn, bm) tiles
    return (2 * bn * d + stages * 2 * bm * d) * elt, 2 * bn * d + 2 * bm * bn


def prune(kind: str):
    """An ``early_config_prune`` hook for kernel ``kind`` ("fwd", "dq" or "dkdv")."""

    def _prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        d, elt = int(args["HEAD_DIM_PAD"]), args["Q"].element_size()
        elt = 2 * elt if elt == 4 else elt  # tf32x3 keeps a high and a low half of each tile
        smem = _max_shared_memory()

        def cost(cfg):
            return _footprint(kind, cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"],
                              cfg.num_stages, d, elt)

        fits = [c for c in configs if cost(c)[0] <= smem
                and cost(c)[1] <= _REGS_PER_THREAD * 32 * c.num_warps]
        if len(fits) > 1:
            return fits[:-1] if fits[-1] is configs[-1] else fits  # fallback not needed
        return fits or [min(configs, key=lambda c: cost(c)[0])]

    return _prune


def autotuned(kernel, kind: str, points):
    """Wrap a ``@triton.jit`` kernel in ``triton.autotune`` with this module's policy."""
    return triton.autotune(configs=make_configs(points),
                           key=["HEAD_DIM_PAD", "MASK_MODE", "SEQ_BUCKET", "TMA"],
                           prune_configs_by={"early_config_prune": prune(kind)})(kernel)
