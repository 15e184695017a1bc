"""lctrain's flash attention in Triton for any block of a masked, GQA, long-context attention:
kernels (``forward``, ``backward``), masks as per-row key intervals (``common``), launchers with
checks, grid and autotuning (``launch``: ``flash_forward``, ``flash_backward``; ``configs``)."""
