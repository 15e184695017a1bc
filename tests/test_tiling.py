"""Sequence-tiled MLP and norms: same losses and gradients as untiled layers (float64), under
every checkpointing policy; replayed dropout; names and state dicts unchanged; bad input."""
import copy

import pytest
import torch

from lctrain.errors import UserError
from lctrain.model.structure import DeferredNorm, bare
from lctrain.parallel.activation_checkpoint import apply_checkpointing
from lctrain.parallel.tiling import TiledModule, apply_tiling
from tiny_llama import tiny_llama

ATTN = "lctrain_test_tiling"


@pytest.fixture(scope="module")
def base_model():
    return tiny_llama(ATTN, vocab=89, layers=2, intermediate=72)


def _step(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 89, (2, 37), generator=g)  # 74 tokens: tiles of 16 leave a part
    loss = model(input_ids=ids, labels=torch.roll(ids, -1, dims=1)).loss
    loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["none", "remat"])  # with the others: test_tiling_tiers
def test_tiled_layers_match_untiled_in_float64(base_model, policy):
    seed = int(torch.randint(0, 1 << 30, ()))
    untiled = copy.deepcopy(base_model)
    ref_loss, ref_grads = _step(untiled, seed)
    tiled = copy.deepcopy(base_model)
    assert apply_tiling(tiled, 16) == 2 * 3 + 1  # mlp and both norms of each layer, final norm
    apply_checkpointing(tiled, policy, offload_min_bytes=0)
    loss, grads = _step(tiled, seed)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-11, atol=1e-13, msg=name)


def test_names_state_dict_and_unwrapping(base_model):
    model = copy.deepcopy(base_model)
    keys = list(model.state_dict())
    apply_tiling(model, 8)
    layer = model.model.layers[0]
    assert isinstance(layer.mlp, TiledModule) and isinstance(layer.input_layernorm, TiledModule)
    assert not isinstance(layer.self_attn, TiledModule)
    # the norm before the MLP runs in the MLP's tiles, registered where it was
    assert isinstance(layer.post_attention_layernorm, DeferredNorm)
    assert layer.mlp.pre is bare(layer.post_attention_layernorm)
    assert list(model.state_dict()) == keys  # as distributed checkpoints name them too
    model.load_state_dict(base_model.state_dict())
    assert apply_tiling(model, 32) == 7 and model.model.layers[0].mlp.tile_tokens == 32
    assert isinstance(model.model.norm, TiledModule)
    assert apply_tiling(model, 0) == 0
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(model.model.layers[0].post_attention_layernorm).__name__ == "LlamaRMSNorm"
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"


def test_short_inputs_run_untiled_and_no_grad_runs_tiled(base_model):
    mlp = copy.deepcopy(base_model.model.layers[0].mlp)
    tiled = TiledModule(mlp, 5)
    x = torch.randn(3, 4, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), mlp(x), rtol=1e-12, atol=1e-15)
    short = torch.randn(1, 5, 32, dtype=torch.float64, requires_grad=True)
    assert tiled(short).grad_fn.name() != "_TiledApplyBackward"


class _DropMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 24, dtype=torch.float64)
        self.down = torch.nn.Linear(24, 8, dtype=torch.float64)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.down(self.drop(self.up(x).relu()))


def test_dropout_masks_are_replayed_in_the_backward():
    """The backward recomputes each tile with the random state of the forward, so the gradient is
    that of the forward that ran: per-tile calls of the plain module from the same seed."""
    mlp = _DropMLP()
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    g = torch.randn(2, 11, 8, dtype=torch.float64)
    seed = int(torch.randint(0, 1 << 30, ()))
    xs = x.clone().requires_grad_()
    torch.manual_seed(seed)
    flat = xs.reshape(1, -1, 8)
    ref = torch.cat([mlp(flat[:, a:a + 4]) for a in range(0, 22, 4)], dim=1).view(2, 11, 8)
    ref.backward(g)
    ref_grads = [xs.grad] + [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    xt = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = TiledModule(mlp, 4)(xt)
    torch.randn(100)  # the backward must not depend on draws made after the forward
    out.backward(g)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip([xt.grad] + [p.grad for p in mlp.parameters()], ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


def test_bad_input_is_one_sentence(base_model):
    with pytest.raises(UserError, match="train.tile_tokens is -1"):
        apply_tiling(copy.deepcopy(base_model), -1)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

    with pytest.raises(UserError, match="has no mlp module"):
        apply_tiling(Net(), 8)

    class Pair(torch.nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(UserError, match="cannot tile Pair"):
        TiledModule(Pair(), 2)(torch.randn(1, 6, 4))
