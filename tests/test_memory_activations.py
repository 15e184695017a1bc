"""The memory model's per-layer activation formula against what a real transformers Llama layer
saves for its backward (bf16, through the lctrain::dist_attention op), measured with
saved-tensor hooks."""
import dataclasses

import pytest
import torch

from lctrain.memory import from_config_dict
from lctrain.memory.activations import layer_saved, remat_kept
from live_bytes import SavedBytes
from tiny_llama import lctrain_attention


@pytest.mark.parametrize("kv_heads, tokens, dtype, fused", [(4, 96, torch.bfloat16, False),
                                                            (2, 160, torch.bfloat16, False),
                                                            (2, 64, torch.float32, False),
                                                            (2, 96, torch.bfloat16, True)])
def test_layer_formula_matches_a_real_llama_layer(kv_heads, tokens, dtype, fused):
    """Transformers' norms and MLPs (as on a CPU) and fused ones (as on a GPU; here in
    Triton's interpreter)."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from lctrain.model.fused import fuse_mlps, fuse_rms_norms

    AttentionInterface.register("lctrain_test_mem", lctrain_attention)
    fields = {"model_type": "llama", "vocab_size": 101, "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": kv_heads}
    config = LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"},
                         use_cache=False)
    model = LlamaForCausalLM(config).to(dtype).train()
    c = dtype.itemsize
    model.set_attn_implementation("lctrain_test_mem")
    if fused:
        assert fuse_rms_norms(model) == 5 and fuse_mlps(model) == 2
    probe = SavedBytes(model, model.model.layers[1])
    ids = torch.randint(0, 101, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
        model(input_ids=ids).logits.float().sum().backward()
    arch = dataclasses.replace(from_config_dict(fields), fused_norms=fused, fused_mlp=fused)
    cos_sin = 2 * tokens * arch.head_dim * c  # RoPE's shared cos/sin, saved by every layer
    assert probe.total - cos_sin == layer_saved(arch, tokens, c)
    assert remat_kept(arch, tokens, c) < layer_saved(arch, tokens, c) / 3


def test_kept_during_layers_walks_the_layers_as_the_offloader_brings_them_back():
    """GPU-kept layers stay until the backward reaches them; a parked layer is on the GPU from
    the moment the layer above it is recomputed (its copies start) until its own backward."""
    import random

    from lctrain.memory.activations import kept_during_layers

    def kept_during_backward(kept, parked):  # the most at any layer
        return max(kept_during_layers(kept, parked))

    g, p = 3, 5  # bytes a GPU-kept and a parked layer keep
    assert kept_during_backward([p] * 4, [True] * 4) == 2 * p  # in use + the next one
    assert kept_during_backward([p], [True]) == p
    # parked below, kept above (auto's order): every kept layer and the first parked one
    assert kept_during_backward([p, p, g, g], [True, True, False, False]) == 2 * g + p
    # kept below, parked above: the parked pair on top of every kept layer
    assert kept_during_backward([g, g, p, p], [False, False, True, True]) == 2 * g + 2 * p
    # layer by layer (forward order): what is still kept when each one's backward runs
    assert kept_during_layers([p, p, g, g], [True, True, False, False]) == [p, 2 * p, g + p,
                                                                          2 * g + p]
    assert kept_during_layers([g, 4 * g, g], [False] * 3) == [g, 5 * g, 6 * g]
    rng = random.Random()
    for _ in range(200):
        n = rng.randrange(1, 9)
        kept = [rng.randrange(1, 100) for _ in range(n)]
        parked = [rng.random() < 0.5 for _ in range(n)]
        got = kept_during_backward(kept, parked)
        assert sum(b for b, q in zip(kept, parked) if not q) <= got <= sum(kept)
        if not any(parked):
            assert got == sum(kept)


def test_the_placements_gpu_bytes_are_the_walks_most():
    """`placement.gpu_bytes`, in closed form, against the walk of the planner's order (parked
    full, parked remat, full, remat) for every count up to 5 of each."""
    import itertools

    from lctrain.memory.activations import kept_during_layers
    from lctrain.memory.placement import gpu_bytes

    big, small = 7, 3
    for rg, rh, fg, fh in itertools.product(range(6), repeat=4):
        kept = [small] * fh + [big] * rh + [small] * fg + [big] * rg
        parked = [True] * (fh + rh) + [False] * (fg + rg)
        walked = max(kept_during_layers(kept, parked), default=0)
        assert gpu_bytes(rg, rh, fg, fh, big, small) == walked, (rg, rh, fg, fh)
