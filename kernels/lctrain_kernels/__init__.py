"""lctrain_kernels: memory-efficient attention with log-sum-exp, DistFlashAttn, fused layer kernels.

Layout everywhere is (batch, seq, heads, head_dim), "BSHD", as flash-attn; keys/values may have
fewer heads than queries. ``cu_seqlens`` (int32, [n_docs + 1], global positions) marks packed
documents; attention never crosses a document boundary when it is given.

    out = attention(q, k, v, causal=True, cu_seqlens=None, softmax_scale=None, backend="auto")
    out, lse = attention_with_lse(...)     # lse: (B, Hq, S) float32, natural log
    out_loc = dist_attention(q_loc, k_loc, v_loc, group=pg, schedule="distflash")

All four are one operator (:mod:`lctrain_kernels.api`, loaded with torch on first use);
:mod:`lctrain_kernels.vocabulary` holds the names, :mod:`lctrain_kernels.distributed` the
sharding and schedules. Depends on torch and triton only.
"""
import importlib

__all__ = ["attention", "attention_with_lse", "dist_attention", "dist_attention_with_lse"]


def __getattr__(name: str):
    """Load the attention API (and torch) on first use of one of its functions (PEP 562)."""
    if name in __all__:
        return getattr(importlib.import_module("lctrain_kernels.api"), name)
    raise AttributeError(f"module 'lctrain_kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
