"""The fused RoPE (`lctrain_kernels.fused.rope`, Triton; on the CPU in Triton's interpreter) against
float64 math and transformers' own apply_rotary_pos_emb, forward and backward, and a model
whose modeling module applies it: same loss and gradients."""
import importlib

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lctrain.model.fused import fuse_rope
from lctrain_kernels.api import rope, rope_supports as supports


def _inputs(dtype, device, b=2, hq=4, hk=2, s=9, d=16, real=True):
    q = torch.randn(b, s, hq, d, device=device).to(dtype).transpose(1, 2)  # as the model's views
    k = torch.randn(b, s, hk, d, device=device).to(dtype).transpose(1, 2)
    if real:  # transformers' own tables: halves repeated
        config = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq, max_position_embeddings=64)
        positions = torch.randint(0, 4096, (b, s), device=device)
        cos, sin = LlamaRotaryEmbedding(config).to(device)(q, positions)
    else:  # unequal halves: the backward must use the transpose, not the inverse of a symmetry
        cos, sin = torch.randn(b, s, d, device=device), torch.randn(b, s, d, device=device)
    return q.requires_grad_(), k.requires_grad_(), cos.to(dtype), sin.to(dtype)


def check(dtype, device, **shape):
    q, k, cos, sin = _inputs(dtype, device, **shape)
    assert supports(q, k, cos, sin)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    got = rope(q, k, cos, sin)
    torch.autograd.backward(got, (dq, dk))
    ours = (*got, q.grad, k.grad)
    q.grad = k.grad = None
    want = apply_rotary_pos_emb(q, k, cos, sin)
    torch.autograd.backward(want, (dq, dk))
    theirs = (*want, q.grad, k.grad)
    q64, k64 = (x.detach().double().requires_grad_() for x in (q, k))
    exact = apply_rotary_pos_emb(q64, k64, cos.double(), sin.double())
    torch.autograd.backward(exact, (dq.double(), dk.double()))
    exact = (*exact, q64.grad, k64.grad)
    one_rounding = 1e-6 if dtype == torch.float32 else 8e-3
    for a, t, e in zip(ours, theirs, exact):
        assert a.shape == e.shape and a.dtype == dtype
        err = lambda x: ((x.double() - e).abs().max() / e.abs().max()).item()
        assert err(a) <= max(err(t), one_rounding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("real", [True, False], ids=["transformers-tables", "any-tables"])
def test_fused_rope_matches_float64_math_at_least_as_well_as_transformers(dtype, real):
    check(dtype, "cpu", real=real)


def test_more_heads_than_one_block_and_mqa():
    check(torch.bfloat16, "cpu", hq=20, hk=1, s=3, d=8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_rope_matches_float64_math_at_least_as_well_as_transformers(dtype):
    check(dtype, "cuda", b=1, hq=32, hk=8, s=4096, d=128)


def test_a_model_applying_the_fused_rope_trains_like_the_plain_one(monkeypatch):
    from transformers import LlamaForCausalLM

    module = importlib.import_module("transformers.models.llama.modeling_llama")
    monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)  # restored
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 96, (2, 24))
    results = []
    for fused in (False, True):
        if fused:
            assert fuse_rope("llama") and fuse_rope("llama")  # once, however often asked
            assert module.apply_rotary_pos_emb.lctrain_fused
            assert module.apply_rotary_pos_emb.__wrapped__ is apply_rotary_pos_emb
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused, fused_grads) = results
    assert torch.allclose(plain, fused, rtol=1e-6, atol=0)
    for name, grad in fused_grads.items():
        assert torch.allclose(grad, plain_grads[name], rtol=1e-4, atol=1e-6), name


def test_other_calls_and_model_types_keep_transformers_rope(monkeypatch):
    module = importlib.import_module("transformers.models.llama.modeling_llama")
    monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)
    assert not fuse_rope("gemma") and not fuse_rope("phi3")
    q, k, cos, sin = _inputs(torch.float32, "cpu")
    assert not supports(q, k, cos, sin, unsqueeze_dim=2)
    assert not supports(q, k, cos.to(torch.bfloat16), sin.to(torch.bfloat16))
    half_not_power_of_2 = (q[..., :12], k[..., :12], cos[..., :12], sin[..., :12])
    assert not supports(*half_not_power_of_2)
    fuse_rope("llama")
    bshd = q.transpose(1, 2), k.transpose(1, 2)  # heads after tokens: unsqueeze_dim=2
    got = module.apply_rotary_pos_emb(*bshd, cos, sin, unsqueeze_dim=2)
    want = apply_rotary_pos_emb(*bshd, cos, sin, unsqueeze_dim=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
