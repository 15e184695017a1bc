"""The RoPE kernel of the head-group block (`lctrain_kernels.fused.rope`, Triton; on the CPU in
Triton's interpreter) against float64 math and transformers' own apply_rotary_pos_emb, forward
and backward (the rotation's transpose)."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lctrain_kernels.api import rotate_tokens


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
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    tokens = lambda *xs: [x.detach().transpose(1, 2) for x in xs]  # (B, S, H, D) views
    heads = lambda *xs: [x.transpose(1, 2) for x in xs]
    ours = (*heads(*rotate_tokens(*tokens(q, k), cos, sin)),
            *heads(*rotate_tokens(*tokens(dq, dk), cos, sin, backward=True)))
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
