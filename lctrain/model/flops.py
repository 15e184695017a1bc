"""The one FLOP model of lctrain: attention FLOPs for the benchmarks, a model's training FLOPs for
MFU, and the GPUs' dense bf16 peaks.

Attention costs 4·H·D FLOPs per visible (query, key) pair in the forward: causal forward = 2·S²·H·D,
backward = 2.5 × forward. Packed documents count Σ n² instead of S². Distributed attention counts
the total sequence and divides by the GPUs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

BACKWARD_FACTOR = 2.5
MODEL = "causal fwd 2*S^2*H*D (4*H*D per visible pair), bwd 2.5x fwd; per GPU: / GPUs"


def attention_flops(seq_len: int, heads: int, head_dim: int, causal: bool = True,
                    bounds: tuple[int, ...] | None = None) -> float:
    """Forward FLOPs of attention over ``seq_len`` tokens with ``heads`` × ``head_dim``: 4·H·D
    per visible (query, key) pair, within the documents of ``bounds`` (0, ..., seq_len)."""
    lengths = [seq_len] if bounds is None else [b - a for a, b in zip(bounds, bounds[1:])]
    pairs = sum(n * n for n in lengths) * (0.5 if causal else 1.0)
    return 4.0 * pairs * heads * head_dim


def rates(forward_flops: float, fwd_ms: float | None, bwd_ms: float | None) -> dict:
    """``{"fwd_tflops", "bwd_tflops", "total_tflops"}`` from the times in milliseconds (a rate
    whose time is missing is left out)."""
    out = {}
    if fwd_ms:
        out["fwd_tflops"] = forward_flops / fwd_ms / 1e9
    if bwd_ms:
        out["bwd_tflops"] = BACKWARD_FACTOR * forward_flops / bwd_ms / 1e9
    if fwd_ms and bwd_ms:
        out["total_tflops"] = (1 + BACKWARD_FACTOR) * forward_flops / (fwd_ms + bwd_ms) / 1e9
    return out


# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity), matched in order against the
# device name (so the PCIe / NVL variants come before the SXM names they contain).
_PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0),
                     ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0), ("B200", 2250.0),
                     ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("A10G", 70.0),
                     ("L4", 121.0))


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None for a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    return None


@dataclass(frozen=True)
class FlopModel:
    """Training FLOPs (forward + backward, recomputation not counted) of a decoder-only LM."""

    per_token: float  # 6 × the trained matrix parameters + 4 × the frozen (no weight gradient)
    per_attention_unit: float  # 7 · layers · H · D, to multiply by Σ n² over the documents

    @classmethod
    def for_model(cls, model_config, n_matmul_params: int, frozen_matmul_params: int = 0
                  ) -> FlopModel:
        """The FLOP model of matrix parameters, ``frozen_matmul_params`` of them not trained."""
        layers = model_config.num_hidden_layers
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        trained = n_matmul_params - frozen_matmul_params
        return cls(per_token=6.0 * trained + 4.0 * frozen_matmul_params,
                   per_attention_unit=7.0 * layers * heads * head_dim)

    def total(self, tokens: float, attention_units: float) -> float:
        """FLOPs of ``tokens`` tokens whose documents give ``attention_units`` = Σ n²."""
        return tokens * self.per_token + attention_units * self.per_attention_unit
