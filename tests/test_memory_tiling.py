"""The memory model's tiled-layer terms against what a real Llama layer does on a CPU: the bytes
a tiled layer saves for its backward (saved-tensor hooks), and a tiled MLP's backward workspace,
which stops growing with the tokens (live-storage peak)."""
import copy

import pytest
import torch

from lctrain.memory import from_config_dict
from lctrain.memory.activations import final_norm_saved, layer_backward, layer_saved
from lctrain.parallel.tiling import TiledModule, apply_tiling
from live_bytes import LiveBytes, SavedBytes
from tiny_llama import lctrain_attention

FIELDS = {"model_type": "llama", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 176,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def _model(dtype):
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("lctrain_test_tile_mem", lctrain_attention)
    config = LlamaConfig(**{k: v for k, v in FIELDS.items() if k != "model_type"}, use_cache=False)
    model = LlamaForCausalLM(config).to(dtype).train()
    model.set_attn_implementation("lctrain_test_tile_mem")
    return model


@pytest.mark.parametrize("tokens, tile, dtype", [(96, 32, torch.bfloat16), (160, 48, torch.float32)])
def test_tiled_layer_saves_what_the_model_says(tokens, tile, dtype):
    model = _model(dtype)
    apply_tiling(model, tile)
    layer_probe = SavedBytes(model, model.model.layers[1])
    norm_probe = SavedBytes(model, model.model.norm)
    ids = torch.randint(0, 101, (1, tokens))

    def pack(t):
        return norm_probe.pack(layer_probe.pack(t))

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids).logits.float().sum().backward()
    arch, c = from_config_dict(FIELDS), dtype.itemsize
    cos_sin = 2 * tokens * arch.head_dim * c  # RoPE's shared cos/sin, saved by every layer
    assert sum(layer_probe.storages.values()) - cos_sin == layer_saved(arch, tokens, c,
                                                                       tile_tokens=tile)
    final_norm = final_norm_saved(arch, tokens, c, tile_tokens=tile)
    assert sum(norm_probe.storages.values()) == final_norm
    assert layer_saved(arch, tokens, c, tile_tokens=tile) < layer_saved(arch, tokens, c) / 2


def _mlp_backward_peak(mlp, tokens, tile):
    """Peak live bytes of the MLP's backward beyond its input, output gradient and input
    gradient (the T-sized tensors any backward has)."""
    x = torch.randn(1, tokens, 64, requires_grad=True)
    grad = torch.randn(1, tokens, 64)
    module = TiledModule(mlp, tile) if tile else mlp
    out = module(x)
    with LiveBytes() as live:
        out.backward(grad)
        peak = live.peak
    return peak - x.numel() * x.element_size()


def test_tiled_mlp_backward_stops_growing_with_tokens():
    mlp = copy.deepcopy(_model(torch.float32).model.layers[0].mlp)
    tile, small, large = 64, 512, 2048
    tiled = [_mlp_backward_peak(mlp, t, tile) for t in (small, large)]
    untiled = [_mlp_backward_peak(mlp, t, 0) for t in (small, large)]
    arch, c = from_config_dict(FIELDS), 4
    inter, h = arch.intermediate_size, arch.hidden_size
    assert untiled[1] - untiled[0] >= 2 * c * (large - small) * inter  # activations of all tokens
    assert tiled[1] - tiled[0] <= 1.5 * c * (large - small) * h  # only the input gradient grows
    bound = 7 * c * tile * inter + c * tile * h + (4 + c) * 3 * h * inter  # the model's tile term
    assert tiled[1] - c * large * h <= bound
    assert layer_backward(arch, large, c, "remat", 1, tile_tokens=tile) < layer_backward(
        arch, large, c, "remat", 1)
