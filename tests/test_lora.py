"""LoRA through peft in one process (training at cp = 2 under FSDP2, resume and the exports are
in test_export_lora.py):

- every checkpointing policy gives the same loss and gradients with LoRA (adapter dropout on,
  a module trained in full), only adapters and that module get gradients, and the attention
  forward runs once per layer (twice under ``full``) with peft's wrapped linear layers;
- the lora section's rules and the module names, checked against the model: one sentence each.
"""
from __future__ import annotations

import copy

import pytest
import torch

from lctrain.config import LoraConfig, load_recipe
from lctrain.errors import ConfigError


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lctrain.model import register_attention

    register_attention()
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float().train()
    model.set_attn_implementation("lctrain")
    return model


def test_every_policy_same_gradients_with_lora(tiny_model):
    from lctrain.model.lora import apply_lora
    from lctrain.config import LayerPlan
    from lctrain.parallel.activation_checkpoint import AttentionCounter, apply_checkpointing

    plans = {"none": "none", "full": "full", "remat": "remat",
             "parked": LayerPlan.parse("remat", "layers")}

    lora = LoraConfig(rank=4, dropout=0.2, trainable_modules=("input_layernorm",))
    ids = torch.randint(0, 97, (2, 24))
    results, runs = {}, {}
    for policy in plans:
        model = apply_lora(copy.deepcopy(tiny_model), lora, seed=3)
        with torch.no_grad():  # B starts at zero: give it values so every gradient flows
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        apply_checkpointing(model, plans[policy], offload_min_bytes=0)
        torch.manual_seed(11)  # the same dropout masks for every policy
        with AttentionCounter() as counter:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        runs[policy] = counter.total
        results[policy] = loss.detach(), {
            n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
            for n, p in model.named_parameters() if p.requires_grad}
    ref_loss, ref_grads = results["none"]
    assert all(".lora_" in n or ".modules_to_save." in n for n in ref_grads)
    assert len(ref_grads) == 3 * (2 * 7 + 1)  # 7 adapted linears + 1 norm copy per layer
    for policy in list(plans)[1:]:
        loss, grads = results[policy]
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7,
                                       msg=f"{policy}: {name}")
    assert runs == {"none": 3, "full": 6, "remat": 3, "parked": 3}


@pytest.mark.parametrize("sets, match", [
    ({"lora.target_modules": "[q_prj]"}, "matches no module.*did you mean 'q_proj'"),
    ({"lora.target_modules": "[lm_head]"}, "output head lm_head"),
    ({"lora.target_modules": "[mlp]"}, "a LlamaMLP and not a linear layer"),
    ({"lora.trainable_modules": "[layers]"}, "a list of modules"),
    ({"lora.trainable_modules": "[self_attn]"}, "holding the adapted layer"),
    ({"lora.trainable_modules": "[lm_head]"}, "output head"),
    ({"lora.trainable_modules": "[nrm]"}, "did you mean 'norm'"),
    ({"lora.trainable_modules": "[embed_tokens]", "model.config.tie_word_embeddings": "true"},
     "ties to the output head"),
])
def test_module_names_are_checked_against_the_model(tmp_path, sets, match):
    from lctrain.model import load_model
    from lctrain.model.lora import apply_lora

    cfg = load_recipe(None, ["lora.rank=2", *[f"{k}={v}" for k, v in sets.items()]])
    model = load_model(None, config=cfg.model.config, seed=0, device="meta")
    with pytest.raises(ConfigError, match=match):
        apply_lora(model, cfg.lora, seed=0)


RULES = [
    (["lora.alpha=8"], "lora.alpha is set but lora.rank is 0"),
    (["lora.rank=-2"], "lora.rank is -2"),
    (["lora.rank=4", "lora.dropout=1.0"], r"lora.dropout is 1.0 but must be in \[0, 1\)"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha is 0"),
    (["lora.rank=4", "lora.target_modules=[]"], "lora.target_modules is empty"),
    (["lora.rank=4", "lora.target_modules=[all-linear,q_proj]"], "mixes all-linear"),
    (["lora.rank=4", "lora.trainable_modules=[norm,norm]"], "names norm twice"),
    (["lora.rank=4", "lora.target_modules=[q_proj]", "lora.trainable_modules=[q_proj]"],
     "adapts too"),
    (["lora.rank=4", "lora.target_modules=[7]"], r"lora.target_modules\[0\] must be a string"),
    (["lora.rank=4", "lora.target_modules=['q proj']"], "not a module name"),
    (["lora.rnk=4"], "did you mean 'lora.rank'"),
]


def test_lora_section_rules():
    cfg = load_recipe(None, ["lora.rank=16"])
    assert cfg.lora.enabled and cfg.lora.scale_alpha == 32.0
    assert cfg.lora.target_modules == ("all-linear",)
    one = load_recipe(None, ["lora.rank=8", "lora.target_modules=q_proj"])
    assert one.lora.target_modules == ("q_proj",)  # one name is a list of one
    assert not load_recipe(None).lora.enabled
    for sets, match in RULES:
        with pytest.raises(ConfigError, match=match):
            load_recipe(None, sets)
