"""What a docsplit plan costs: host work per kernel call plus FLOPs at each kernel's rate.

:mod:`lctrain_kernels.docsplit` can run each document of a packed block on the dense kernel
(cuDNN, only FULL or causal squares, much faster per FLOP on long documents) or leave it to
the masked kernel (Triton, any mask, one call for the whole block). Splitting pays per call:
a call costs host work (argument checks, cuDNN's plan lookup, Triton's launcher, the copies of
its rows into the block's result) whatever its size, while a short document is only
microseconds of GPU work. So the planner prices every choice and runs the cheapest, and runs
the whole block as ONE masked call whenever that is cheaper than any split.

The price of a call, in microseconds, for a block of ``work = B·Hq·D`` (forward + backward
take 14 FLOPs per visible (query, key) pair per unit of work)::

    dense call    dense_call_us  + 14·work·(pairs + dense_row_pairs ·rows) / dense_tflops
    masked call   masked_call_us + 14·work·(pairs + masked_row_pairs·rows) / masked_tflops
    gathered      + gather_call_us + 14·work·gather_row_pairs·rows / dense_tflops

``pairs`` are the pairs the kernel computes (padding included), ``rows`` its query rows. The
``*_row_pairs`` terms are what a kernel pays per row beyond the visible pairs: the part-masked
tiles along each diagonal and document edge (the masked kernel's are wider), and for a call
whose rows are gathered into a batch (not views) the copies in and out, priced in pairs of
dense work. Host work and GPU work are simply added: host work overlaps the GPU only while
the GPU is busier, so the sum errs towards fewer calls, never towards a split that loses.

:data:`GPU_MODEL` holds the defaults for a Hopper GPU with cuDNN and our Triton kernels
(bf16, head dim 128), calibrated with ``python scripts/gpu_docsplit.py`` (per-call costs from
back-to-back tiny calls, rates from batched equal documents at several lengths, checked on the
document mixes of its table). Pass your own :class:`CostModel` to re-calibrate for another
machine. :data:`CPU_MODEL` has no per-call costs (CPU ops run synchronously and the dense op
beats the masked one at every size), so on a CPU every document long enough runs dense.
"""
from __future__ import annotations

from dataclasses import dataclass

#: forward + backward FLOPs per visible pair per unit of B·Hq·D (4 forward, backward 2.5x).
FLOPS_PER_PAIR = 14


@dataclass(frozen=True)
class CostModel:
    """Per-call costs (µs, forward + backward) and rates (TFLOP/s, forward + backward) of the
    dense and masked kernels; see the module docstring for how they price a call."""

    dense_call_us: float
    masked_call_us: float
    gather_call_us: float
    dense_tflops: float
    masked_tflops: float
    dense_row_pairs: float
    masked_row_pairs: float
    gather_row_pairs: float

    def dense_us(self, pairs: int, rows: int, work: int) -> float:
        """One dense call computing ``pairs`` over ``rows`` query rows (views, no copies)."""
        flops = FLOPS_PER_PAIR * work * (pairs + self.dense_row_pairs * rows)
        return self.dense_call_us + flops / (self.dense_tflops * 1e6)

    def masked_us(self, pairs: int, rows: int, work: int, calls: int = 1) -> float:
        """``calls`` masked calls computing ``pairs`` visible pairs over ``rows`` query rows."""
        flops = FLOPS_PER_PAIR * work * (pairs + self.masked_row_pairs * rows)
        return calls * self.masked_call_us + flops / (self.masked_tflops * 1e6)

    def gather_us(self, rows: int, work: int) -> float:
        """Gathering ``rows`` rows into one batch and scattering the results back."""
        flops = FLOPS_PER_PAIR * work * self.gather_row_pairs * rows
        return self.gather_call_us + flops / (self.dense_tflops * 1e6)


#: Hopper (H100 / H200), cuDNN dense calls, Triton masked calls; see the module docstring.
GPU_MODEL = CostModel(dense_call_us=300.0, masked_call_us=300.0, gather_call_us=150.0,
                      dense_tflops=560.0, masked_tflops=450.0, dense_row_pairs=256.0,
                      masked_row_pairs=600.0, gather_row_pairs=700.0)

#: a CPU: no per-call cost, the dense op (torch's CPU flash) well ahead of the masked one,
#: copies cheap but not free (views win a tie).
CPU_MODEL = CostModel(dense_call_us=0.0, masked_call_us=0.0, gather_call_us=0.0,
                      dense_tflops=2.0, masked_tflops=1.0, dense_row_pairs=0.0,
                      masked_row_pairs=0.0, gather_row_pairs=1.0)
