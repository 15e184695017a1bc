"""Attention blocks run one head group at a time, projections included: the losses and every
gradient of transformers' module (float64), under every checkpointing policy, with GQA, biases
(Qwen2) and documents; remat keeps the block's output so the attention runs once; names, state
dicts, what is not wrapped, a generation call; what a grouped layer keeps (the memory model);
on a GPU, bf16 with the fused RoPE kernel."""
import copy
import dataclasses

import pytest
import torch

from lctrain.config.layers import LayerPlan
from lctrain.memory import from_config_dict
from lctrain.memory.activations import layer_saved
from lctrain.model import CPContext
from lctrain.model.attention import register_attention
from lctrain.model.grouped_attention import GroupedAttention, apply_grouped_attention
from lctrain.model.structure import DeferredNorm
from lctrain.parallel.activation_checkpoint import AttentionCounter, apply_checkpointing
from lctrain.parallel.tiling import apply_tiling
from live_bytes import SavedBytes

VOCAB = 61


def _model(model_type="llama", heads=8, kv_heads=4, dtype=torch.float64, layers=2, hidden=64):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=hidden,
                                  intermediate_size=96, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  max_position_embeddings=256, tie_word_embeddings=False,
                                  use_cache=False)
    torch.manual_seed(int(torch.randint(0, 1 << 30, ())))
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    model.set_attn_implementation(register_attention())
    return model


def _step(model, ids, policy="none", **call):
    """One step with ``policy``: ``train.checkpointing``, then ``train.offload`` after a "/"."""
    model = copy.deepcopy(model)
    checkpointing, _, offload = policy.partition("/")
    apply_checkpointing(model, LayerPlan.parse(checkpointing, offload or "none"),
                        offload_min_bytes=0)
    with AttentionCounter() as counter:
        loss = model(input_ids=ids, labels=ids, **call).loss
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad
             for n, p in model.named_parameters()}
    return loss.detach(), grads, dict(counter.counts)


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-13, atol=0)
    assert got[1].keys() == want[1].keys()
    for name, grad in got[1].items():
        torch.testing.assert_close(grad, want[1][name], rtol=1e-11, atol=1e-13, msg=name)


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("policy, forwards", [("none", 2), ("remat", 2), ("full", 4),
                                              ("remat=1,full=1/layers", 3)])
def test_grouped_layers_match_transformers_module_in_float64(groups, policy, forwards):
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 37))
    want = _step(model, ids, policy)
    grouped = copy.deepcopy(model)
    assert apply_grouped_attention(grouped, groups) == 2
    got = _step(grouped, ids, policy)
    _assert_same(got, want)
    # remat keeps the block's (out, lse): one attention forward per layer; full runs it again
    assert got[2] == {"lctrain::attention_block": forwards}


@pytest.mark.parametrize("policy, defer", [("none", True), ("remat", True), ("remat", False),
                                           ("full=1,remat=1/layers", True),
                                           ("remat=1,full=1/layers=1", False)])
def test_grouped_and_tiled_layers_match_in_float64(policy, defer):
    """Both norms deferred (to the block and to the MLP's tiles) or not, tiles that leave a
    part."""
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 37))
    want = _step(model, ids, policy)
    both = copy.deepcopy(model)
    apply_grouped_attention(both, 2, defer_norm=defer)
    # per layer the MLP and its norm, and the first norm unless the block runs it; final norm
    assert apply_tiling(both, 16, defer_norm=defer) == 2 * (2 + (not defer)) + 1
    layer = both.model.layers[0]
    assert isinstance(layer.input_layernorm, DeferredNorm) == defer
    assert isinstance(layer.post_attention_layernorm, DeferredNorm) == defer
    _assert_same(_step(both, ids, policy), want)


def test_biases_and_documents_match():
    """Qwen2's q/k/v biases, and packed documents (the mask from cp_context)."""
    model = _model("qwen2", heads=4, kv_heads=2)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = torch.randint(0, VOCAB, (1, 50))
    ctx = CPContext(cu_seqlens=[0, 13, 14, 41, 50], backend="reference")
    want = _step(model, ids, "remat", cp_context=ctx)
    grouped = copy.deepcopy(model)
    apply_grouped_attention(grouped, 2)
    _assert_same(_step(grouped, ids, "remat", cp_context=ctx), want)


def test_names_state_dict_unwrapping_and_what_is_left_alone():
    model = _model()
    keys = list(model.state_dict())
    assert apply_grouped_attention(model, 4) == 2
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, GroupedAttention) and "head_groups=4" in repr(attn)
    assert isinstance(model.model.layers[0].input_layernorm, DeferredNorm)  # run by the block
    assert list(model.state_dict()) == keys
    assert apply_grouped_attention(model, 2) == 2  # a new count replaces the old
    assert model.model.layers[0].self_attn.head_groups == 2
    assert apply_grouped_attention(model, 1) == 0  # one group: transformers' module
    assert not isinstance(model.model.layers[0].self_attn, GroupedAttention)
    assert type(model.model.layers[0].input_layernorm).__name__ == "LlamaRMSNorm"
    assert list(model.state_dict()) == keys
    with pytest.raises(ValueError, match="divisor of the 4 key/value heads"):
        GroupedAttention(model.model.layers[0].self_attn, 3)
    qwen3 = _model("qwen3", heads=4, kv_heads=2)  # per-head norms: not this block
    assert apply_grouped_attention(qwen3, 2) == 0
    other = _model()
    other.set_attn_implementation("eager")  # not lctrain's attention
    assert apply_grouped_attention(other, 2) == 0


def test_lora_projections_are_left_to_transformers():
    from lctrain.config.schema import LoraConfig
    from lctrain.model.lora import apply_lora

    model = apply_lora(_model(), LoraConfig(rank=4, target_modules=("q_proj", "v_proj")), seed=0)
    assert apply_grouped_attention(model, 2) == 0


def test_a_generation_call_with_a_cache_runs_the_module():
    model = _model().eval()
    grouped = copy.deepcopy(model)
    apply_grouped_attention(grouped, 2)
    ids = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True).logits
        got = grouped(input_ids=ids, use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kv_heads, groups, tile, defer", [
    (4, 2, 0, True), (2, 2, 0, True), (4, 4, 0, True), (4, 2, 32, True), (4, 2, 0, False),
    (4, 2, 32, False)])
def test_a_grouped_layer_keeps_what_the_memory_model_counts(kv_heads, groups, tile, defer):
    """bf16, no checkpointing: what layer 1 saves for its backward (saved-tensor hooks), with
    and without tiles, with the norms inside the block and the MLP's tiles or not."""
    fields = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": kv_heads}
    model = _model(heads=4, kv_heads=kv_heads, dtype=torch.bfloat16)
    apply_grouped_attention(model, groups, defer_norm=defer)
    apply_tiling(model, tile, defer_norm=defer)
    assert isinstance(model.model.layers[1].input_layernorm, DeferredNorm) == defer
    probe = SavedBytes(model, model.model.layers[1])
    tokens, c = 96, 2
    ids = torch.randint(0, VOCAB, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
        model(input_ids=ids).logits.float().sum().backward()
    arch = dataclasses.replace(from_config_dict(fields), fused_norms=False, fused_mlp=False,
                               norm_in_tiles=defer, norm_in_attention=defer)
    cos_sin = 2 * tokens * arch.head_dim * c  # RoPE's shared cos/sin, saved by every layer
    saved = layer_saved(arch, tokens, c, tile_tokens=tile, head_groups=groups)
    assert probe.total - cos_sin == saved
    assert saved < layer_saved(arch, tokens, c, tile_tokens=tile)


@pytest.mark.gpu
def test_bf16_on_a_gpu_with_the_fused_rope_matches_the_module():
    """cuDNN's attention, bf16: the block with lctrain's RoPE kernel against transformers' module
    with Liger's, within bf16 rounding (the input's gradient is rounded once per
    group)."""
    from lctrain.model.fused import fuse_rope

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    fuse_rope("llama")
    model = _model(heads=32, kv_heads=8, dtype=torch.bfloat16, layers=1, hidden=1024).cuda()
    ids = torch.randint(0, VOCAB, (1, 4096), device="cuda")
    want = _step(model, ids, "remat")
    grouped = copy.deepcopy(model)
    apply_grouped_attention(grouped, 8, fused_rope=True)
    got = _step(grouped, ids, "remat")
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=0)
    for name, grad in got[1].items():
        ref = want[1][name].float()
        err = (grad.float() - ref).norm() / ref.norm()
        assert err < 2e-2, (name, float(err))
