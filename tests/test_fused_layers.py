"""Liger-Kernel's norm, SwiGLU, RoPE and fused loss in transformers models (`lctrain.model.fused`):
which modules switch (CPU), and on a GPU the same loss and gradients as the plain model, the loss
against float64 math, and the loss's working set against the memory model."""
import importlib
import sys

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fused_model import check_fused_model_trains_alike, tiny_llama
from lctrain.errors import ConfigError
from lctrain.model.fused import (MLP_CLASSES, NORM_CLASSES, fuse_mlps, fuse_rms_norms, fuse_rope,
                                 fused_cross_entropy)
from lctrain_kernels.api import chunked_cross_entropy


def test_only_norms_with_llamas_arithmetic_are_switched():
    gemma = torch.nn.Sequential(GemmaRMSNorm(16))  # scales by 1 + weight: not fused
    assert fuse_rms_norms(gemma) == 0 and type(gemma[0]) is GemmaRMSNorm
    assert "GemmaRMSNorm" not in NORM_CLASSES
    llama = torch.nn.Sequential(LlamaRMSNorm(16), LlamaRMSNorm(16))
    weights = [m.weight for m in llama]
    assert fuse_rms_norms(llama) == 2 and type(llama[0]) is type(llama[1])
    assert fuse_rms_norms(llama) == 2 and isinstance(llama[0], LlamaRMSNorm)  # idempotent
    assert [m.weight for m in llama] == weights and type(llama[0]).__name__ == "FusedLlamaRMSNorm"


def test_only_silu_mlps_are_switched():
    gelu = tiny_llama(hidden_act="gelu")
    assert fuse_mlps(gelu) == 0 and type(gelu.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert "LlamaMLP" in MLP_CLASSES
    swish = tiny_llama(hidden_act="swish")  # torch's nn.SiLU
    assert fuse_mlps(swish) == 2


def test_rope_is_switched_for_llamas_formula_only_and_stays_transformers_on_a_cpu(monkeypatch):
    module = importlib.import_module("transformers.models.llama.modeling_llama")
    original = module.apply_rotary_pos_emb
    monkeypatch.setattr(module, "apply_rotary_pos_emb", original)  # restored after the test
    assert not fuse_rope("gemma") and not fuse_rope("phi3")
    assert fuse_rope("llama") and fuse_rope("llama")  # once, however often asked
    assert module.apply_rotary_pos_emb.__wrapped__ is original
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)
    cos, sin = torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    got, want = module.apply_rotary_pos_emb(q, k, cos, sin), original(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_without_liger_kernel_the_switch_is_one_sentence(monkeypatch):
    for name in [n for n in sys.modules if n.startswith("liger_kernel")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as when not installed
    with pytest.raises(ConfigError, match="pip install liger-kernel, or set model.fused_kernels"):
        fuse_rms_norms(torch.nn.Sequential(LlamaRMSNorm(8)))


@pytest.mark.gpu
def test_gpu_fused_model_trains_like_the_plain_one(monkeypatch):
    module = importlib.import_module("transformers.models.llama.modeling_llama")
    monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)

    def fuse(model):
        fuse_rope("llama")
        return fuse_rms_norms(model) + fuse_mlps(model)

    fused = check_fused_model_trains_alike(fuse, switched=2 * 2 + 1 + 2)
    assert type(fused.model.layers[0].mlp).__name__ == "FusedLlamaMLP"


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["remat", "full"])
def test_gpu_fused_model_in_head_groups_and_tiles_trains_like_the_plain_one(monkeypatch, policy):
    """The long-context build (`lctrain.parallel.build`): Liger's layers, then head groups with
    the norm and RoPE inside, tiles with the MLP's norm inside, checkpointing."""
    from lctrain.model import register_attention
    from lctrain.model.fused import fuse_model
    from lctrain.model.grouped_attention import apply_grouped_attention
    from lctrain.parallel.activation_checkpoint import apply_checkpointing
    from lctrain.parallel.tiling import apply_tiling

    module = importlib.import_module("transformers.models.llama.modeling_llama")
    monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)
    plain = tiny_llama().cuda()
    fused = tiny_llama().cuda()
    fused.load_state_dict(plain.state_dict())
    register_attention()
    fused.set_attn_implementation("lctrain")  # head groups run lctrain's attention only
    fuse_model(fused)
    assert apply_grouped_attention(fused, 2, fused_rope=True, defer_norm=True) == 2
    assert apply_tiling(fused, 16, defer_norm=True) == 2 * 2 + 1  # MLPs (norm inside), final norm
    apply_checkpointing(fused, policy, offload_min_bytes=0)
    ids = torch.randint(0, 96, (2, 40), device="cuda")  # 80 tokens: tiles of 16
    losses = []
    for model in (plain, fused):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    got = {n.replace("._checkpoint_wrapped_module", ""): p.grad
           for n, p in fused.named_parameters()}
    assert got.keys() == grads.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-3, atol=1e-5, msg=name)


def _float64_loss(h, w, labels):
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    loss = torch.nn.functional.cross_entropy(h64 @ w64.T, labels, ignore_index=-100,
                                             reduction="sum")
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_loss_matches_float64_math_at_least_as_well_as_the_chunked_one(dtype):
    tokens, vocab, hidden = 1500, 32000, 256
    h = (torch.randn(tokens, hidden, device="cuda") * 2).to(dtype)
    w = (torch.randn(vocab, hidden, device="cuda") / hidden**0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    labels[torch.rand(tokens, device="cuda") < 0.25] = -100
    exact = _float64_loss(h, w, labels)
    results = []
    for loss_fn in (fused_cross_entropy, lambda a, b, y: chunked_cross_entropy(a, b, y, 512)):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = loss_fn(a, b, labels)
        loss.backward()
        assert loss.dtype == torch.float32 and a.grad.dtype == b.grad.dtype == dtype
        results.append((loss.detach(), a.grad, b.grad))

    def err(x, e):
        return ((x.double() - e).abs().max() / e.abs().max()).item()

    one_rounding = 1e-5 if dtype == torch.float32 else 8e-3
    for fused, chunked, e in zip(*results, exact):
        assert err(fused, e) <= max(1.1 * err(chunked, e), one_rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [3000, 40000])
def test_gpu_fused_loss_working_set_is_the_memory_models(tokens):
    from lctrain.memory.activations import loss_workspace
    from lctrain.memory.arch import from_config_dict

    vocab, hidden = 32000, 1024
    arch = from_config_dict({"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
                             "intermediate_size": 2816, "num_hidden_layers": 2,
                             "num_attention_heads": 8})
    assert arch.fused_loss
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    fused_cross_entropy(h[:8], w, labels[:8])  # cuBLAS's workspace, once per process
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fused_cross_entropy(h, w, labels)
    peak = torch.cuda.max_memory_allocated() - base
    want = loss_workspace(arch, tokens, 2, 8192)
    assert abs(peak - want) <= 0.05 * want + (1 << 20), (peak, want)
