"""Checkpointing on a tiny Llama: identical gradients, attention forward run counts, what the
attention backward receives, and the parked layers' host offload (remat, train.offload=layers)."""
import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lctrain.config import LayerPlan
from lctrain.errors import UserError
from lctrain.model.structure import decoder_layer_slots
from lctrain.parallel.activation_checkpoint import AttentionCounter, apply_checkpointing
from tiny_llama import lctrain_attention, tiny_llama

LAYERS = 3
DIST = "lctrain_test_dist"
REFERENCE = "lctrain_test_reference"
POLICIES = ("none", "full", "remat", "parked")
"""Every layer's kind, and remat with every layer parked in host memory."""


@pytest.fixture(scope="module")
def base_model():
    from transformers import AttentionInterface

    from lctrain.model import register_attention

    AttentionInterface.register(DIST, lctrain_attention)
    register_attention()
    return tiny_llama(REFERENCE, vocab=97, layers=LAYERS, intermediate=64, max_positions=256,
                      dtype=torch.float32)


def _model(base, policy, attn=DIST, **kwargs):
    model = copy.deepcopy(base)
    model.set_attn_implementation(attn)
    apply_checkpointing(model, LayerPlan.parse("remat", "layers") if policy == "parked" else policy,
                        **kwargs)
    return model


def _batch(seed=1, seq=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _step(model, ids, labels):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


def test_finds_the_decoder_layers(base_model):
    model = copy.deepcopy(base_model)
    layers = decoder_layer_slots(model)
    assert [c[i] for c, i in layers] == list(model.model.layers)
    assert apply_checkpointing(model, "remat") == LAYERS
    assert len(decoder_layer_slots(model)) == LAYERS  # wrapped layers are still found
    assert apply_checkpointing(model, "none") == 0
    assert list(model.model.layers) == [c[i] for c, i in layers]  # unwrapped again


def test_generic_fallback_without_no_split_modules():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 1)])
            self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.heads[0](x)

    net = Net()
    assert apply_checkpointing(net, "full") == 3
    assert all(type(b).__name__ == "CheckpointWrapper" for b in net.blocks)
    with pytest.raises(UserError, match="'sometimes' is not one of none, remat, full"):
        apply_checkpointing(net, "sometimes")
    with pytest.raises(UserError, match="decoder layers"):
        apply_checkpointing(torch.nn.Linear(2, 2), "full")


@pytest.mark.parametrize("attn", [DIST, "lctrain", REFERENCE])
def test_same_gradients_and_attention_runs(base_model, attn):
    """Local attention (cp = 1) is one op for every backend ("lctrain" takes auto: cpu_flash
    here): remat keeps its output, so the attention forward runs once per layer."""
    ids, labels = _batch()
    results, runs = {}, {}
    for policy in POLICIES:
        model = _model(base_model, policy, attn=attn, offload_min_bytes=0)
        with AttentionCounter() as counter:
            results[policy] = _step(model, ids, labels)
        runs[policy] = counter.total
    ref_loss, ref_grads = results["none"]
    for policy in POLICIES[1:]:
        loss, grads = results[policy]
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7,
                                       msg=f"{policy}: {name}")
    assert runs == {"none": LAYERS, "full": 2 * LAYERS, "remat": LAYERS,
                    "parked": LAYERS}


class _AttentionTrace(TorchDispatchMode):
    """Keeps the tensors entering and leaving the dist attention forward and backward ops."""

    def __init__(self):
        super().__init__()
        self.forward, self.backward = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.lctrain.dist_attention.default:
            self.forward.append((args[:3], out))
        elif func is torch.ops.lctrain.dist_attention_backward.default:
            self.backward.append(args[:6])
        return out


@pytest.mark.parametrize("policy", ["remat", "parked"])
def test_backward_gets_recomputed_qkv_and_saved_out_lse(base_model, policy):
    model = _model(base_model, policy, offload_min_bytes=0)
    ids, labels = _batch(seed=2)
    with _AttentionTrace() as trace:
        loss = model(input_ids=ids, labels=labels).loss
        if policy == "parked":  # the kept (out, lse) wait on the host meanwhile
            assert all(t.untyped_storage().nbytes() == 0 for _, outs in trace.forward for t in outs)
        loss.backward()
    assert len(trace.forward) == len(trace.backward) == LAYERS
    for (qkv, (out, lse)), (do, q, k, v, b_out, b_lse) in zip(trace.forward,
                                                              reversed(trace.backward)):
        assert b_out.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        assert b_lse.untyped_storage().data_ptr() == lse.untyped_storage().data_ptr()
        for fwd, bwd in zip(qkv, (q, k, v)):  # recomputed: equal values, fresh tensors
            assert bwd.untyped_storage().data_ptr() != fwd.untyped_storage().data_ptr()
            torch.testing.assert_close(bwd, fwd, rtol=0, atol=0)


def test_offload_releases_layer_inputs(base_model):
    alive = {}
    for policy in ("remat", "parked"):
        model = _model(base_model, policy, offload_min_bytes=0)
        inputs = []
        hook = model.model.layers[1].register_forward_pre_hook(
            lambda mod, args: inputs.append(weakref.ref(args[0])))
        ids, labels = _batch(seed=3)
        loss = model(input_ids=ids, labels=labels).loss
        alive[policy] = inputs[0]() is not None
        loss.backward()
        hook.remove()
    assert alive == {"remat": True, "parked": False}


def test_offload_keeps_small_tensors_in_place(base_model):
    model = _model(base_model, "parked")  # default threshold: 1 MiB, far above these
    ids, labels = _batch(seed=4)
    with _AttentionTrace() as trace:
        loss = model(input_ids=ids, labels=labels).loss
        assert all(t.untyped_storage().nbytes() > 0 for _, outs in trace.forward for t in outs)
        loss.backward()


def _gpu_model(layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=8192)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).cuda().train()


@pytest.mark.gpu
def test_parked_layers_move_memory_to_host_on_gpu(base_model):
    base, tokens, hidden = _gpu_model(), 4096, 256
    ids = torch.randint(0, 512, (1, tokens), device="cuda")
    kept, grads = {}, {}
    for policy in ("remat", "parked"):
        model = _model(base, policy)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        kept[policy] = torch.cuda.memory_allocated() - before
        loss.backward()
        grads[policy] = {n: p.grad for n, p in model.named_parameters()}
    # per layer: its input and the attention output, fp32 (the lse is under the 1 MiB threshold)
    parked = 4 * 2 * tokens * hidden * 4
    assert kept["remat"] - kept["parked"] >= 0.9 * parked, kept
    for name, grad in grads["remat"].items():
        torch.testing.assert_close(grads["parked"][name], grad)


@pytest.mark.gpu
def test_parked_layers_pin_exact_sizes_and_reuse_them(base_model):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from lctrain.parallel.offload import Offloader

    base, tokens, hidden = _gpu_model(), 3000, 256  # 3000 x 256 x 4 bytes: no power of two
    ids = torch.randint(0, 512, (1, tokens), device="cuda")
    model = _model(base, "parked")
    pools = {id(a.pool): a.pool for m in model.modules() if isinstance(m, CheckpointWrapper)
             for a in m.checkpoint_fn.args if isinstance(a, Offloader)}
    sizes = []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        sizes.append(sum(p.pinned_bytes for p in pools.values()))
    assert pools and sizes[0] == sizes[1] == 4 * 2 * tokens * hidden * 4, sizes
    assert all(b.is_pinned() for p in pools.values() for b in p._all)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", [DIST, "lctrain"])
def test_remat_runs_attention_once_on_gpu_in_bf16(base_model, attn):
    base = _gpu_model().to(torch.bfloat16)
    ids = torch.randint(0, 512, (1, 2048), device="cuda")
    runs, grads = {}, {}
    for policy in ("none", "full", "remat"):
        model = _model(base, policy, attn=attn)
        with AttentionCounter() as counter:
            grads[policy] = _step(model, ids, ids)[1]
        runs[policy] = counter.total
    assert runs == {"none": 4, "full": 8, "remat": 4}
    for name, grad in grads["none"].items():  # bf16 kernels may reduce in another order
        err = (grads["remat"][name].float() - grad.float()).abs().max()
        assert err <= 2e-2 * grad.float().abs().max(), name
