"""What lctrain adds to a decoder layer beside the attention: the attention block in head groups,
with its RoPE kernel. Norms, SwiGLU, a model's RoPE and the fused loss run Liger-Kernel's."""
