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
  with no atomics (``backward.py``);

* a backward that folds a gradient of the lse into delta (``delta = rowsum(dO * O) - dlse``),
  so a loss on the lse costs nothing extra.

Layers: kernels (``forward.py``, ``backward.py``) → launchers with checks, grid and autotuning
(``launch.py``, ``configs.py``) → the ``triton`` backend (``lctrain_kernels.backends.triton``)
→ the one attention operator, ``torch.ops.lctrain.dist_attention`` (custom op with fake kernel
and autograd), behind :func:`lctrain_kernels.attention` and ``dist_attention``.

Usage::

    from lctrain_kernels import attention_with_lse
    out, lse = attention_with_lse(q, k, v, causal=True, backend="triton")   # differentiable
    out, lse = flash_forward(q, k, v, causal=True)        # one block, no autograd
"""
from lctrain_kernels.triton.launch import flash_backward, flash_forward

__all__ = ["flash_backward", "flash_forward"]
