"""lctrain's flash attention in Triton: any block of a masked, GQA, long-context attention.

FlashAttention-2's online softmax, tile by tile, never storing the (Sq, Sk) scores; it returns
the output and the natural log-sum-exp of every row, all the backward and the merge of partial
results need. Added for lctrain: masks in GLOBAL positions (offset causal diagonals, packed
documents) as one visible key interval per row (``common``), so tiles nobody sees are skipped
and only edge tiles pay for the mask; GQA by index; any Sq / Sk; head dims 16..256; a backward
from the FINAL (merged) out and lse that folds the lse's gradient into delta (``backward``).
Layers: kernels (``forward``, ``backward``) → launchers with checks, grid and autotuning
(``launch``, ``configs``) → the triton backend → the one attention op.
"""
from lctrain_kernels.triton.launch import flash_backward, flash_forward

__all__ = ["flash_backward", "flash_forward"]
