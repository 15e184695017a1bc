"""lctrain's own flash attention in Triton: any block of a masked, GQA, long-context attention.

FlashAttention-2 computes ``softmax(Q K^T * scale + mask) V`` tile by tile without ever
storing the (Sq, Sk) attention matrix: each program keeps a running row maximum, a running
sum of exponentials and a float32 output accumulator for its query tile, rescaling them as
new key tiles arrive (the "online softmax"; base-2 exponentials with log2(e) folded into the
scale). It returns the output and the natural log-sum-exp ``lse`` of every query row — all
that the backward pass and the merge of partial results (DistFlashAttn) need.

What this implementation adds for lctrain:

* masks in GLOBAL positions — causal with arbitrary ``q_start`` / ``k_start`` (the offset
  diagonal blocks of a distributed schedule) and packed documents (``cu_seqlens``) — seen by
  the kernels as one visible key interval per query row (``common.py``). Tiles outside every
  row's interval are skipped, tiles inside all of them run unmasked, only edge tiles pay for
  the elementwise mask;
* GQA by index (query head h reads K/V head h // group), any Sq / Sk (ragged tails), head
  dims 16..256 (padded to a power of two with masked loads), fp16 / bf16 / fp32;
* a backward that starts from the FINAL (merged) out and lse: delta = rowsum(dO * O), then
  a dK/dV kernel that loops over the query heads of its GQA group and a separate dQ kernel,
  with no atomics (``backward.py``).

Layers (STYLE.md): kernels (``forward.py``, ``backward.py``) → launchers with checks, grid and
autotuning (``launch.py``, ``configs.py``) → torch custom ops with fake kernels and autograd
(``ops.py``) → :func:`triton_attention`. The Backend-protocol wrapper lives in
``lctrain_kernels.backends.triton``.

Usage::

    from lctrain_kernels.triton import triton_attention
    out, lse = triton_attention(q, k, v, causal=True)          # q (B, S, Hq, D), k/v (B, S, Hkv, D)
"""
from lctrain_kernels.triton.launch import flash_backward, flash_forward
from lctrain_kernels.triton.ops import triton_attention

__all__ = ["flash_backward", "flash_forward", "triton_attention"]
