"""Per-layer checkpointing: each layer unchecked, or remat or full with its kept tensors on the
device or parked in host memory (the lowest layers) — same loss and gradients as no
checkpointing (float64, with tiles), attention forwards run once per remat layer and twice per
full one, what is parked, and the first parked layer's copies started before the backward
needs them."""
import copy
import weakref

import pytest
import torch

from lctrain.config import LayerPlan
from lctrain.errors import UserError
from lctrain.parallel import offload
from lctrain.parallel.activation_checkpoint import AttentionCounter, apply_checkpointing
from lctrain.parallel.tiling import apply_tiling
from tiny_llama import tiny_llama

ATTN = "lctrain_test_tiers"
MIXED = LayerPlan.parse("full=1,remat=1,full=1,remat=1", "layers=2")


@pytest.fixture(scope="module")
def base_model():
    return tiny_llama(ATTN, vocab=83, layers=4, intermediate=64)


def _step(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 83, (2, 29), generator=g)
    loss = model(input_ids=ids, labels=torch.roll(ids, -1, dims=1)).loss
    loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


@pytest.mark.parametrize("plan", [MIXED, LayerPlan.parse("remat=3,full=1", "layers=1"),
                                  LayerPlan.parse("full=1,remat=1,none=2", "layers"),
                                  LayerPlan.parse("remat", "layers=3")])
def test_mixed_layers_match_no_checkpointing(base_model, plan):
    seed = int(torch.randint(0, 1 << 30, ()))
    ref_loss, ref_grads = _step(copy.deepcopy(base_model), seed)
    model = copy.deepcopy(base_model)
    apply_tiling(model, 13)
    kinds = plan.kinds(4)
    wrapped = apply_checkpointing(model, plan, offload_min_bytes=0)
    assert wrapped == 4 - kinds.count("none")
    with AttentionCounter() as counter:
        loss, grads = _step(model, seed)
    assert counter.total == 4 + kinds.count("full")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-11, atol=1e-13, msg=name)


def test_parked_layers_release_what_they_park_and_gpu_layers_keep_it(base_model):
    model = copy.deepcopy(base_model)
    apply_checkpointing(model, MIXED, offload_min_bytes=0)
    inputs = {}

    def keep(i, args):
        inputs.setdefault(i, weakref.ref(args[0]))  # returns None: the arguments stay

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: keep(i, args))
    ids = torch.randint(0, 83, (1, 40))
    loss = model(input_ids=ids, labels=ids).loss
    alive = [inputs[i]() is not None for i in range(4)]
    assert alive == [False, False, True, True]  # inputs of parked layers wait on the host
    loss.backward()


def test_gpu_kept_layers_start_the_first_offloaded_copies(base_model, monkeypatch):
    """The backward reaches the GPU-kept layers first; their recompute starts the copies of the
    topmost parked layer, before that layer unpacks anything; each parked layer's recompute
    starts the copies of the one below it."""
    events = []
    fetch, unpack = offload.LayerStash.fetch, offload.LayerStash.unpack

    def record_fetch(self):
        events.append(("fetch", id(self), self.ready is not None))
        return fetch(self)

    def record_unpack(self, packed):
        events.append(("unpack", id(self), None))
        return unpack(self, packed)

    monkeypatch.setattr(offload.LayerStash, "fetch", record_fetch)
    monkeypatch.setattr(offload.LayerStash, "unpack", record_unpack)
    model = copy.deepcopy(base_model)
    apply_checkpointing(model, MIXED, offload_min_bytes=0)
    ids = torch.randint(0, 83, (1, 40))
    model(input_ids=ids, labels=ids).loss.backward()
    unpacked = list(dict.fromkeys(stash for kind, stash, _ in events if kind == "unpack"))
    assert len(unpacked) == 2
    lower_fetch = next(i for i, e in enumerate(events) if e[0] == "fetch" and e[1] == unpacked[1])
    assert lower_fetch < events.index(("unpack", unpacked[1], None))  # started by the one above
    newest = unpacked[0]
    first_fetch = events.index(next(e for e in events if e[0] == "fetch" and e[1] == newest))
    first_unpack = events.index(("unpack", newest, None))
    assert first_fetch < first_unpack and events[first_fetch][2] is False


def test_bad_layers_are_one_sentence(base_model):
    model = copy.deepcopy(base_model)
    with pytest.raises(UserError, match="covers 3 layers but the model has 4"):
        apply_checkpointing(model, "remat=3")
    with pytest.raises(UserError, match="'sometimes=1'"):
        apply_checkpointing(model, "remat=3,sometimes=1")
    with pytest.raises(UserError, match="auto has no kinds"):
        apply_checkpointing(model, "auto")
    with pytest.raises(UserError, match="parks 5 layers but the model has 4"):
        apply_checkpointing(model, LayerPlan.parse("remat", "layers=5"))


@pytest.mark.gpu
def test_mixed_layers_pin_what_the_model_says_on_gpu():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lctrain.memory import from_config_dict
    from lctrain.memory.activations import host_offload

    fields = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(**fields, max_position_embeddings=8192)).cuda().train()
    model = model.to(torch.bfloat16)
    from lctrain.model import register_attention

    register_attention()  # before the model is told to use it
    model.set_attn_implementation("lctrain")
    apply_checkpointing(model, MIXED, offload_min_bytes=0)
    tokens = 3000
    ids = torch.randint(0, 512, (1, tokens), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    pools = {id(a.pool): a.pool for m in model.modules() if hasattr(m, "checkpoint_fn")
             for a in getattr(m.checkpoint_fn, "args", ()) if isinstance(a, offload.Offloader)}
    arch = from_config_dict({"model_type": "llama", **fields})
    assert sum(p.pinned_bytes for p in pools.values()) == host_offload(
        arch, tokens, 2, MIXED.kinds(4), MIXED.parked_layers(4))
