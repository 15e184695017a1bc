"""The fused RMSNorm (`lctrain_kernels.fused.rms_norm`, Triton; on the CPU in Triton's interpreter)
against float64 math and against transformers' own LlamaRMSNorm, forward and backward, and the
class switch on a real model: same parameters and names, same loss and gradients."""
import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fused_model import check_fused_model_trains_alike
from lctrain.model.fused import NORM_CLASSES, fuse_rms_norms
from lctrain_kernels.api import rms_norm


def _reference(x, w, eps, dtype):
    """transformers' arithmetic in float64 with the forward's rounding of the normalized input
    to ``dtype`` (its gradient passes straight through, unrounded)."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    rounded = normed + (normed.to(dtype).double() - normed).detach()
    return w.double() * rounded


@pytest.mark.parametrize("dtype, wdtype", [(torch.float32, torch.float32),
                                           (torch.bfloat16, torch.bfloat16),
                                           (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("shape", [(2, 7, 48), (1, 33, 40), (3, 1, 64)])
def test_fused_rms_norm_matches_float64_math_at_least_as_well_as_transformers(dtype, wdtype,
                                                                              shape):
    check_against_transformers(dtype, wdtype, shape, "cpu")


def test_more_rows_than_the_backward_has_programs():
    check_against_transformers(torch.bfloat16, torch.bfloat16, (1, 700, 16), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, wdtype", [(torch.bfloat16, torch.bfloat16),
                                           (torch.float16, torch.float16),
                                           (torch.bfloat16, torch.float32)])
def test_gpu_fused_rms_norm_matches_float64_math_at_least_as_well_as_transformers(dtype, wdtype):
    check_against_transformers(dtype, wdtype, (2, 3000, 4096), "cuda")


def check_against_transformers(dtype, wdtype, shape, device):
    """Output, input gradient and weight gradient against float64 math: never further than
    transformers' own."""
    hidden, eps = shape[-1], 1e-5
    x = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(hidden, device=device)).to(wdtype).requires_grad_()
    dy = torch.randn(shape, dtype=torch.promote_types(dtype, wdtype), device=device)

    hf = LlamaRMSNorm(hidden, eps=eps).to(device=device, dtype=wdtype)
    with torch.no_grad():
        hf.weight.copy_(w)
    x_hf = x.detach().clone().requires_grad_()
    want = hf(x_hf)
    want.backward(dy)
    got = rms_norm(x, w, eps)
    got.backward(dy)
    assert got.dtype == want.dtype and got.shape == want.shape

    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = _reference(x64, w64, eps, dtype)
    ref.backward(dy.double())
    out_tol = 1e-6 if dtype == torch.float32 else 4e-3  # one rounding of the input's dtype

    def err(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    assert err(got, ref) <= max(err(want, ref), out_tol)
    for ours, theirs, exact in ((x.grad, x_hf.grad, x64.grad), (w.grad, hf.weight.grad, w64.grad)):
        assert ours.dtype == theirs.dtype
        one_rounding = 1e-5 if ours.dtype == torch.float32 else 4e-3
        assert err(ours, exact) <= max(1.5 * err(theirs, exact), one_rounding)


def test_fused_norms_keep_the_model_and_its_loss_and_gradients():
    fused = check_fused_model_trains_alike(fuse_rms_norms, switched=2 * 2 + 1)
    assert all(type(m).__name__ == "FusedLlamaRMSNorm" for name, m in fused.named_modules()
               if name.endswith("norm"))


def test_only_norms_with_llamas_arithmetic_are_switched():
    gemma = torch.nn.Sequential(GemmaRMSNorm(16))  # scales by 1 + weight: not fused
    assert fuse_rms_norms(gemma) == 0 and type(gemma[0]) is GemmaRMSNorm
    assert "GemmaRMSNorm" not in NORM_CLASSES
    llama = torch.nn.Sequential(LlamaRMSNorm(16), LlamaRMSNorm(16))
    assert fuse_rms_norms(llama) == 2 and type(llama[0]) is type(llama[1])
    assert fuse_rms_norms(llama) == 2 and isinstance(llama[0], LlamaRMSNorm)  # idempotent
