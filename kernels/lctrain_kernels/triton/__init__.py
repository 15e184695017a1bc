"""lctrain's flash attention in Triton for any block of a masked, GQA, long-context attention:
kernels (``forward``, ``backward``), masks as per-row key intervals (``common``), launchers with
checks, grid and autotuning (``launch``, ``configs``)."""
from lctrain_kernels.triton.launch import flash_backward, flash_forward

__all__ = ["flash_backward", "flash_forward"]
