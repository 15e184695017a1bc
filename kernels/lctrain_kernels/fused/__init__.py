"""Fused kernels of a decoder layer: RMSNorm, RoPE, SwiGLU, the chunked loss and the attention
block in head groups. They compute in float32 and round once (``triton.common.round_to``)."""
