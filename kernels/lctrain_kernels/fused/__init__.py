"""What lctrain adds to a decoder layer beside the attention: the attention block in head groups
(with its RoPE kernel) and the chunked loss. Norms, SwiGLU and a model's RoPE run Liger-Kernel's."""
