"""The training loss: summed token cross-entropy through the output head, one chunk of logits
at a time (`lctrain_kernels.api.chunked_cross_entropy`; its Triton kernel on GPUs)."""
from lctrain_kernels.api import chunked_cross_entropy

__all__ = ["chunked_cross_entropy"]
