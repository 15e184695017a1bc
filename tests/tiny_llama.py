"""A tiny Llama whose attention is lctrain's own, for exact tests of the transforms applied to
decoder layers (tiling, checkpointing policies, per-layer placement).

    model = tiny_llama("lctrain_test_x", vocab=89, layers=2, intermediate=72)   # float64

`reference_attention` is transformers' attention interface over `lctrain_kernels.attention`
(the plain-torch backend unless told), so float64 models stay float64 end to end;
`lctrain_attention` runs the ``lctrain::dist_attention`` op as lctrain's models do.
"""
from __future__ import annotations

import torch

import lctrain_kernels


def reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        backend="reference", **kwargs):
    """transformers attention through lctrain_kernels.attention; (B, S, Hq, D), no weights."""
    out = lctrain_kernels.attention(query.transpose(1, 2), key.transpose(1, 2),
                                    value.transpose(1, 2), causal=True, softmax_scale=scaling,
                                    backend=backend)
    return out, None


def lctrain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """transformers attention through the ``lctrain::dist_attention`` op on one rank (group
    None, causal, the automatic backend): what lctrain's models run, saved tensors included."""
    out = lctrain_kernels.dist_attention(query.transpose(1, 2), key.transpose(1, 2),
                                         value.transpose(1, 2), group=None, causal=True,
                                         softmax_scale=scaling)
    return out, None


def tiny_llama(attention: str, *, vocab: int, layers: int, intermediate: int,
               max_positions: int = 128, dtype: torch.dtype = torch.float64):
    """A seeded LlamaForCausalLM (hidden 32, 4 heads, 2 key/value heads, untied head) in
    training mode, whose attention is `reference_attention` registered as ``attention``."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register(attention, reference_attention)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype).train()
    model.set_attn_implementation(attention)
    return model
