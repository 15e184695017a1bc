"""The memory model's per-layer activation formula against what a real transformers Llama layer
saves for its backward (bf16, through the lctrain::dist_attention op), measured with
saved-tensor hooks."""
import pytest
import torch

from lctrain.memory import from_config_dict
from lctrain.memory.activations import layer_saved, remat_kept
from live_bytes import SavedBytes
from tiny_llama import lctrain_attention


@pytest.mark.parametrize("kv_heads, tokens, dtype", [(4, 96, torch.bfloat16),
                                                     (2, 160, torch.bfloat16),
                                                     (2, 64, torch.float32)])
def test_layer_formula_matches_a_real_llama_layer(kv_heads, tokens, dtype):
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("lctrain_test_mem", lctrain_attention)
    fields = {"model_type": "llama", "vocab_size": 101, "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": kv_heads}
    config = LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"},
                         use_cache=False)
    model = LlamaForCausalLM(config).to(dtype).train()
    c = dtype.itemsize
    model.set_attn_implementation("lctrain_test_mem")
    probe = SavedBytes(model, model.model.layers[1])
    ids = torch.randint(0, 101, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
        model(input_ids=ids).logits.float().sum().backward()
    arch = from_config_dict(fields)
    cos_sin = 2 * tokens * arch.head_dim * c  # RoPE's shared cos/sin, saved by every layer
    assert probe.total - cos_sin == layer_saved(arch, tokens, c)
    assert remat_kept(arch, tokens, c) < layer_saved(arch, tokens, c) / 3
