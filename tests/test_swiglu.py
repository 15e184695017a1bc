"""The fused SiLU product of the gated MLP (`lctrain_kernels.fused.swiglu`, Triton; on the CPU in
Triton's interpreter) against float64 math and against transformers' eager arithmetic, forward
and backward, and the class switch on a real model: same parameters and names, same loss and
gradients."""
import pytest
import torch
from transformers.activations import ACT2FN

from fused_model import check_fused_model_trains_alike, tiny_llama
from lctrain.model.fused import MLP_CLASSES, fuse_mlps
from lctrain_kernels.api import swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 7, 48), (1, 33, 40), (3, 700, 5)])
def test_fused_swiglu_matches_float64_math_at_least_as_well_as_transformers(dtype, shape):
    check_against_transformers(dtype, shape, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_swiglu_matches_float64_math_at_least_as_well_as_transformers(dtype):
    check_against_transformers(dtype, (2, 3000, 14336), "cuda")


def check_against_transformers(dtype, shape, device):
    """Output and both input gradients against float64 math: never further than transformers'
    ``act_fn(gate) * up``."""
    gate = (torch.randn(shape, device=device) * 4).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device).to(dtype).requires_grad_()
    dh = torch.randn(shape, device=device).to(dtype)

    gate_hf, up_hf = (t.detach().clone().requires_grad_() for t in (gate, up))
    want = ACT2FN["silu"](gate_hf) * up_hf
    want.backward(dh)
    got = swiglu(gate, up)
    got.backward(dh)
    assert got.dtype == want.dtype and got.shape == want.shape

    gate64, up64 = (t.detach().double().requires_grad_() for t in (gate, up))
    ref = torch.nn.functional.silu(gate64) * up64
    ref.backward(dh.double())
    one_rounding = 1e-6 if dtype == torch.float32 else 4e-3 if dtype == torch.bfloat16 else 5e-4

    def err(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    for ours, theirs, exact in ((got, want, ref), (gate.grad, gate_hf.grad, gate64.grad),
                                (up.grad, up_hf.grad, up64.grad)):
        assert ours.dtype == theirs.dtype
        assert err(ours, exact) <= max(err(theirs, exact), one_rounding)


def test_inputs_of_different_shapes_or_dtypes_are_refused():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(a, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(a, a.to(torch.bfloat16))


def test_fused_mlps_keep_the_model_and_its_loss_and_gradients():
    fused = check_fused_model_trains_alike(fuse_mlps, switched=2)
    assert all(type(layer.mlp).__name__ == "FusedLlamaMLP" for layer in fused.model.layers)


def test_only_silu_mlps_are_switched():
    gelu = tiny_llama(hidden_act="gelu")
    assert fuse_mlps(gelu) == 0 and type(gelu.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert "LlamaMLP" in MLP_CLASSES
    swish = tiny_llama(hidden_act="swish")  # torch's nn.SiLU
    assert fuse_mlps(swish) == 2
