"""Checkpointing under FSDP2 the way the runner composes them (policy first, then `distribute`
over the layers that `decoder_layers` finds), on a one-rank gloo group: same gradients as
without checkpointing, attention forwards once per layer under remat."""
import copy
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lctrain.config import LayerPlan
from lctrain.parallel.activation_checkpoint import AttentionCounter, apply_checkpointing

LAYERS = 3
POLICIES = {"none": "none", "full": "full", "remat": "remat",
            "parked": LayerPlan.parse("full=1,remat=2", "layers=2")}


@pytest.fixture(scope="module")
def world_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def base_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lctrain.model import register_attention

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    model.set_attn_implementation(register_attention())
    return model


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_policies_under_fsdp2(world_mesh, base_model, param_dtype):
    from lctrain.model.structure import decoder_layers
    from lctrain.parallel.fsdp import distribute

    ids = torch.randint(0, 97, (1, 40))
    grads, runs = {}, {}
    for policy, layers_plan in POLICIES.items():
        model = copy.deepcopy(base_model)
        apply_checkpointing(model, layers_plan, offload_min_bytes=0)
        layers = decoder_layers(model)
        assert all(type(l).__name__ == ("CheckpointWrapper" if policy != "none" else
                                         "LlamaDecoderLayer") for l in layers)
        distribute(model, layers, world_mesh=world_mesh, strategy="fsdp", param_dtype=param_dtype)
        with AttentionCounter() as counter:
            model(input_ids=ids, labels=ids).loss.backward()
        runs[policy] = counter.total
        grads[policy] = {n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()
                         for n, p in model.named_parameters()}
    assert runs == {"none": LAYERS, "full": 2 * LAYERS, "remat": LAYERS, "parked": LAYERS + 1}
    for policy in list(POLICIES)[1:]:
        for name, grad in grads["none"].items():
            if param_dtype is None:
                torch.testing.assert_close(grads[policy][name], grad, rtol=1e-6, atol=1e-7)
            else:  # bf16 compute: recomputation is deterministic on a CPU, so still equal
                torch.testing.assert_close(grads[policy][name], grad, rtol=0, atol=0)
