"""lctrain_kernels: memory-efficient attention with log-sum-exp, and DistFlashAttn.

Layout everywhere is (batch, seq, heads, head_dim) — "BSHD", as flash-attn. Keys/values may have
fewer heads than queries (GQA/MQA). ``cu_seqlens`` (int32, [n_docs + 1], global positions) marks
packed documents; attention never crosses a document boundary when it is given.

    out = attention(q, k, v, causal=True, cu_seqlens=None, softmax_scale=None, backend="auto")
    out, lse = attention_with_lse(...)     # lse: (B, Hq, S) float32, natural log
    out_loc = dist_attention(q_loc, k_loc, v_loc, group=pg, schedule="distflash")

This package depends on torch and triton only.
"""
from lctrain_kernels.api import attention, attention_with_lse
from lctrain_kernels.distributed import dist_attention, dist_attention_with_lse

__all__ = ["attention", "attention_with_lse", "dist_attention", "dist_attention_with_lse"]
