"""LoRA in the memory model: trainable counts equal peft's, a real LoRA layer saves what the
formula says, and only trainable weights carry gradients and optimizer state."""
import dataclasses

import pytest
import torch

import lctrain_kernels
from lctrain.config import LoraConfig, load_recipe
from lctrain.errors import UserError
from lctrain.memory import (
    estimate,
    estimate_recipe,
    from_config_dict,
    load_architecture,
    lora_shape,
)
from lctrain.memory import adapters as lora_model
from lctrain.memory.activations import layer_saved
from lctrain.memory.adapters import trainable_parameters

FIELDS = {"model_type": "llama", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 176,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
CASES = [
    LoraConfig(rank=8),
    LoraConfig(rank=4, target_modules=("q_proj", "v_proj"), trainable_modules=("input_layernorm",)),
    LoraConfig(rank=8, target_modules=("down_proj",), trainable_modules=("embed_tokens", "norm")),
    LoraConfig(rank=8, target_modules=("q_proj",), trainable_modules=("o_proj", "gate_proj")),
    LoraConfig(rank=8, target_modules=("k_proj", "up_proj"), dropout=0.1),
    LoraConfig(rank=2, dropout=0.1, trainable_modules=("post_attention_layernorm",)),
]


def _dist_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    out = lctrain_kernels.dist_attention(query.transpose(1, 2), key.transpose(1, 2),
                                         value.transpose(1, 2), group=None, softmax_scale=scaling)
    return out, None


def _lora_model(lora: LoraConfig, dtype=torch.float32):
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from lctrain.model.lora import apply_lora

    AttentionInterface.register("lctrain_test_lora_mem", _dist_attention)
    config = LlamaConfig(**{k: v for k, v in FIELDS.items() if k != "model_type"},
                         use_cache=False, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype).train()
    model.set_attn_implementation("lctrain_test_lora_mem")
    return apply_lora(model, lora, seed=0)


@pytest.mark.parametrize("lora", CASES, ids=range(len(CASES)))
def test_trainable_count_matches_peft(lora):
    peft_model = _lora_model(lora)
    arch = from_config_dict(FIELDS)
    trained = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable_parameters(arch, lora_shape(lora)) == trained
    # peft keeps the frozen originals of fully trained modules: base + trainable in all
    assert sum(p.numel() for p in peft_model.parameters()) == arch.parameters() + trained


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["eager", "fused"])
@pytest.mark.parametrize("lora", CASES, ids=range(len(CASES)))
def test_layer_formula_matches_a_real_lora_layer(lora, fused):
    """Transformers' norms and MLPs (as on a CPU) and Liger's (on a GPU)."""
    from lctrain.model.fused import fuse_mlps, fuse_rms_norms

    peft_model = _lora_model(lora, torch.bfloat16).to("cuda" if fused else "cpu")
    if fused:  # peft keeps a trained norm's frozen original beside it: more than 5
        assert fuse_rms_norms(peft_model) >= 5 and fuse_mlps(peft_model) == 2
    tokens, c = 80, 2
    arch = dataclasses.replace(from_config_dict(FIELDS), fused_norms=fused, fused_mlp=fused)
    # the CPU's dropout keeps its scaled noise in the compute dtype; a GPU keeps a 1-byte mask
    expected = lora_model.layer_saved(arch, tokens, c, lora_shape(lora),
                                      mask_bytes=1 if fused else c)
    assert _layer_saved_bytes(peft_model, tokens) == expected


@pytest.mark.parametrize("lora", CASES, ids=range(len(CASES)))
def test_tiled_layer_formula_matches_a_real_lora_layer(lora):
    """The MLP and its norm in tiles (the norm inside the MLP's), the first norm tiled."""
    from lctrain.parallel.tiling import apply_tiling

    peft_model = _lora_model(lora, torch.bfloat16)
    apply_tiling(peft_model, 32)
    tokens, c = 80, 2
    arch = from_config_dict(FIELDS)
    expected = lora_model.tiled_layer_saved(arch, tokens, c, lora_shape(lora), mask_bytes=c)
    assert _layer_saved_bytes(peft_model, tokens) == expected


def _layer_saved_bytes(peft_model, tokens: int, c: int = 2) -> int:
    """Bytes layer 1 saves for its backward beyond parameters and RoPE's shared cos/sin."""
    layer = peft_model.base_model.model.model.layers[1]
    params = {p.untyped_storage().data_ptr() for p in peft_model.parameters()}
    state, storages = {"on": False}, {}
    layer.register_forward_pre_hook(lambda *a: state.update(on=True))
    layer.register_forward_hook(lambda *a: state.update(on=False))

    def pack(t):
        storage = t.untyped_storage()
        if state["on"] and storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ids = torch.randint(0, 101, (1, tokens), device=peft_model.device)
        peft_model(input_ids=ids).logits.float().sum().backward()
    cos_sin = 2 * tokens * from_config_dict(FIELDS).head_dim * c  # saved by every layer
    return sum(storages.values()) - cos_sin


def test_only_trainable_weights_have_gradients_and_optimizer_state():
    arch = load_architecture("llama3-8b")
    lora = lora_shape(LoraConfig(rank=16, trainable_modules=("embed_tokens", "norm")))
    trainable = trainable_parameters(arch, lora)
    full = estimate(arch, 131072, 2, 2, "remat")
    low = estimate(arch, 131072, 2, 2, "remat", lora=lora)
    assert low.details["trainable_parameters"] == trainable < arch.parameters() / 10
    assert low.per_gpu_bytes["parameters"] == (arch.parameters() + trainable) * 4 // 2
    assert low.per_gpu_bytes["gradients"] == 0  # no accumulation: freed by the peak
    assert low.per_gpu_bytes["optimizer"] == 2 * trainable * 4 // 2
    assert full.per_gpu_bytes["optimizer"] == 2 * arch.parameters() * 4 // 2
    # remat keeps the same tensors; the head's fp32 gradient is gone from the loss
    assert low.details["saved_activations"] == full.details["saved_activations"]
    vh = arch.vocab_size * arch.hidden_size
    # the fused loss's float32 head gradient, and its bf16 copy once the chunk of logits is gone
    logits = 2048 * arch.vocab_size * 2  # Liger's chunk: about the hidden states' size
    assert (full.details["loss_workspace"] - low.details["loss_workspace"]
            == vh * 4 + max(logits, vh * 2) - logits)
    assert low.per_gpu_bytes["total"] < full.per_gpu_bytes["total"]
    assert low.max_seq_len is None and estimate(arch, 131072, 2, 2, "remat", lora=lora,
                                                gpu_memory=139 << 30).max_seq_len > 131072
    # frozen norms keep less (fused: the same either way)
    eager = dataclasses.replace(arch, fused_norms=False, fused_mlp=False)
    none = estimate(eager, 8192, 2, 2, "none", lora=lora).details["saved_activations"]
    assert none < estimate(eager, 8192, 2, 2, "none").details["saved_activations"]


def test_recipe_lora_reaches_the_estimate_and_unknown_names_are_refused():
    cfg = load_recipe("llama-7b-64k", ["lora.rank=8"])
    est = estimate_recipe(cfg, seq_len=65536, gpus=2, gpu_memory=80 << 30)
    assert est.details["lora_rank"] == 8
    assert est.details["trainable_parameters"] == trainable_parameters(
        load_architecture("llama-7b"), lora_shape(cfg.lora))
    odd = load_recipe("llama-7b-64k", ["lora.rank=8", "lora.target_modules=[query_key_value]"])
    with pytest.raises(UserError, match="names query_key_value, which the memory model does not"):
        estimate_recipe(odd, seq_len=65536, gpus=2, gpu_memory=80 << 30)
    assert layer_saved(load_architecture("llama-7b"), 16, 2) > 0  # the full-FT path is unchanged
