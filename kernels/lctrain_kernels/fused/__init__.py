"""Fused kernels of a decoder layer, each a Triton kernel per direction behind a custom op, an
autograd function and a functional API: RMSNorm (``rms_norm``), RoPE (``rope``), the gated MLP's
SiLU product (``swiglu``), the chunked loss (``loss``), and the attention block run in head
groups with its projections (``block``). They compute in float32 and round once, identically on
the GPU and in Triton's CPU interpreter (``triton.common.round_to``)."""
