"""The memory model's activation terms against bytes measured on a CPU: what a real transformers
Llama layer and its final norm save for the backward (through the lctrain::dist_attention op;
saved-tensor hooks), and the parts of the activation peak built from them; with Liger's norms
and MLPs, on a GPU."""
import dataclasses

import pytest
import torch

from lctrain.memory import from_config_dict
from lctrain.memory.activations import final_norm_saved, layer_saved, remat_kept
from lctrain.memory.estimate import Setup, _grads_made, breakdown
from live_bytes import SavedBytes
from tiny_llama import lctrain_attention


@pytest.mark.parametrize("kv_heads, tokens, dtype, fused", [(4, 96, torch.bfloat16, False),
                                                            (2, 160, torch.bfloat16, False),
                                                            (2, 64, torch.float32, False),
                                                            pytest.param(2, 96, torch.bfloat16, True,
                                                                         marks=pytest.mark.gpu)])
def test_layer_formula_matches_a_real_llama_layer(kv_heads, tokens, dtype, fused):
    """Transformers' norms and MLPs (as on a CPU) and Liger's (on a GPU)."""
    fields = {"model_type": "llama", "vocab_size": 101, "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": kv_heads}
    model, c = _llama(fields, dtype, fused), dtype.itemsize
    probe = SavedBytes(model, model.model.layers[1])
    ids = torch.randint(0, 101, (1, tokens), device=model.device)
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
        model(input_ids=ids).logits.float().sum().backward()
    arch = dataclasses.replace(from_config_dict(fields), fused_norms=fused, fused_mlp=fused)
    cos_sin = 2 * tokens * arch.head_dim * c  # RoPE's shared cos/sin, saved by every layer
    assert probe.total - cos_sin == layer_saved(arch, tokens, c)
    assert remat_kept(arch, tokens, c) < layer_saved(arch, tokens, c) / 3



def _llama(fields, dtype, fused):
    """A tiny Llama in training mode on lctrain's attention (fused: Liger's norms and MLPs, on a
    GPU)."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from lctrain.model.fused import fuse_mlps, fuse_rms_norms

    AttentionInterface.register("lctrain_test_mem", lctrain_attention)
    config = LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"},
                         use_cache=False)
    model = LlamaForCausalLM(config).to(dtype=dtype, device="cuda" if fused else "cpu").train()
    model.set_attn_implementation("lctrain_test_mem")
    if fused:
        assert fuse_rms_norms(model) == 5 and fuse_mlps(model) == 2
    return model


@pytest.mark.parametrize("moment, dtype, fused", [
    ("layer", torch.float32, False), ("layer", torch.bfloat16, False),
    pytest.param("layer", torch.float32, True, marks=pytest.mark.gpu),
    pytest.param("layer", torch.bfloat16, True, marks=pytest.mark.gpu),
    ("loss", torch.float32, False), ("loss", torch.bfloat16, False)])
def test_the_activation_peak_keeps_the_measured_layers_and_final_norm(moment, dtype, fused):
    """At either moment of the activation peak (the loss's backward with a large vocabulary,
    the top layer's backward with a small one) the breakdown's activations are every layer's
    saved tensors and the final norm's (its saved tensors and its output, which the loss reads),
    as measured; the rest of the peak is the loss's working set, or the layer's backward less
    the final norm, which is gone by then."""
    vocab, tokens = {"layer": (101, 192), "loss": (2048, 512)}[moment]
    fields = {"model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2}
    model = _llama(fields, dtype, fused)
    layers = [SavedBytes(model, layer) for layer in model.model.layers]
    norm = SavedBytes(model, model.model.norm)
    model.model.norm.register_forward_hook(lambda m, i, out: norm.storages.__setitem__(
        out.untyped_storage().data_ptr(), out.untyped_storage().nbytes()))

    def pack(t):
        for probe in (*layers, norm):
            probe.pack(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(0, vocab, (1, tokens), device=model.device))
    c = dtype.itemsize
    arch = dataclasses.replace(from_config_dict(fields), fused_norms=fused, fused_mlp=fused,
                               fused_loss=fused)  # on a CPU the chunked loss
    cos_sin = 2 * tokens * arch.head_dim * c  # RoPE's shared cos/sin, saved by every layer
    kept = sum(probe.total - cos_sin for probe in layers)
    assert kept == len(layers) * layer_saved(arch, tokens, c)
    # the model leaves out the float32 rsqrt per token of transformers' final norm
    slack = 0 if fused else 4 * tokens
    assert 0 <= norm.total - final_norm_saved(arch, tokens, c) <= slack

    setup = Setup(arch=arch, gpus=1, cp=1, layers="none", dtype=str(dtype).split(".")[1],
                  fsdp=False, loss_chunk_tokens=64)
    per_gpu, details = breakdown(setup, tokens)
    assert details["phase"] == "activations"
    assert 0 <= kept + norm.total - details["saved_activations"] <= slack
    assert per_gpu["activations"] == details["saved_activations"]  # kept at either moment
    rest = per_gpu["other"] - details["headroom"]
    if moment == "loss":
        assert rest == details["loss_workspace"]
    else:  # beside the head's gradient, made by then
        assert per_gpu["gradients"] == vocab * arch.hidden_size * c
        assert 0 <= rest - (details["layer_backward"] - norm.total) <= slack


def test_the_gradients_made_before_each_layers_backward_are_what_autograd_holds():
    """A real Llama's backward on a CPU: when each layer's backward begins, the gradients already
    accumulated are the head's and those of every layer above (and the final norm's, which the
    model leaves out)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {"model_type": "llama", "vocab_size": 101, "hidden_size": 64,
              "intermediate_size": 176, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2}
    config = LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    model = LlamaForCausalLM(config).train()
    held = {}

    def grads_now():
        return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                   if p.grad is not None)

    for i, layer in enumerate(model.model.layers):
        layer.register_full_backward_pre_hook(lambda m, g, i=i: held.__setitem__(i, grads_now()))
    ids = torch.randint(0, 101, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    setup = Setup(arch=from_config_dict(fields), gpus=1, cp=1, layers="none", dtype="float32",
                  fsdp=False)
    final_norm = 4 * fields["hidden_size"]
    assert [held[i] - final_norm for i in range(3)] == _grads_made(setup, 4, 4)


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
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
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
        during = kept_during_layers(kept, parked)
        assert gpu_bytes(rg, rh, fg, fh, big, small) == max(during, default=0), (rg, rh, fg, fh)
        for g in (2, 5):  # with the gradients made on the way down, g per layer
            n = len(kept)
            walked = max((b + g * (n - 1 - i) for i, b in enumerate(during)), default=0)
            got = gpu_bytes(rg, rh, fg, fh, big, small, g * max(n - 1, 0))
            assert got == walked, (rg, rh, fg, fh, g)
