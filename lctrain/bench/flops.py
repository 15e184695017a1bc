"""The one FLOP model of every lctrain benchmark (and of the attention part of MFU).

Attention costs 4·H·D floating-point operations per visible (query, key) pair in the forward
(two matrix products of 2·D each, per head). Causal attention sees half of the S² pairs, so

    causal forward   = 2·S²·H·D        (non-causal: 4·S²·H·D)
    backward         = 2.5 × forward   (five products against the forward's two)
    forward+backward = 3.5 × forward   (7·S²·H·D causal)

With packed documents only the pairs inside each document count, Σ n² instead of S² (the
"useful" FLOPs; `lctrain.bench.documents.Documents` counts through this model): a kernel
that skips the empty tiles shows it as a higher rate, one that does not, as a lower one. For
the distributed attention S is the TOTAL sequence and the figure is divided by the number of
GPUs ("TFLOP/s per GPU"), so a perfect split of the work matches the one-GPU rate.
"""
from __future__ import annotations

BACKWARD_FACTOR = 2.5
MODEL = "causal fwd 2*S^2*H*D (4*H*D per visible pair), bwd 2.5x fwd; per GPU: / GPUs"


def attention_flops(seq_len: int, heads: int, head_dim: int, causal: bool = True,
                    bounds: tuple[int, ...] | None = None) -> float:
    """Forward FLOPs of attention over one sequence of ``seq_len`` tokens.

    Args:
        seq_len: tokens in the sequence (the total one for distributed attention).
        heads: query heads H.
        head_dim: head dimension D.
        causal: causal mask (half the pairs) or full attention.
        bounds: document boundaries (0, ..., seq_len), or None for one document.

    Returns:
        4·H·D × the visible (query, key) pairs.
    """
    lengths = [seq_len] if bounds is None else [b - a for a, b in zip(bounds, bounds[1:])]
    pairs = sum(n * n for n in lengths) * (0.5 if causal else 1.0)
    return 4.0 * pairs * heads * head_dim


def rates(forward_flops: float, fwd_ms: float | None, bwd_ms: float | None) -> dict:
    """TFLOP/s of a forward, its backward and both, from their times in milliseconds.

    Returns:
        ``{"fwd_tflops", "bwd_tflops", "total_tflops"}`` (a rate whose time is missing is
        left out).
    """
    out = {}
    if fwd_ms:
        out["fwd_tflops"] = forward_flops / fwd_ms / 1e9
    if bwd_ms:
        out["bwd_tflops"] = BACKWARD_FACTOR * forward_flops / bwd_ms / 1e9
    if fwd_ms and bwd_ms:
        out["total_tflops"] = (1 + BACKWARD_FACTOR) * forward_flops / (fwd_ms + bwd_ms) / 1e9
    return out
