"""Paired layers (``full-paired``): the upper layer of each pair keeps no input and rebuilds it
from the layer below in the backward — the same loss and gradients as no checkpointing
(float64, with tiles, beside offloaded layers), its input freed after the forward, one more
forward of the lower layer per pair, and the settings that cannot work refused."""
import copy
import weakref

import pytest
import torch

from lctrain.config.tiers import parse_layer_policies, per_layer
from lctrain.errors import UserError
from lctrain.parallel.activation_checkpoint import AttentionCounter, apply_checkpointing
from lctrain.parallel.tiling import apply_tiling
from tiny_llama import tiny_llama

ATTN = "lctrain_test_pairs"


@pytest.fixture(scope="module")
def base_model():
    return tiny_llama(ATTN, vocab=83, layers=5, intermediate=64)


def _step(model, seed, steps=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 83, (2, 29), generator=g)
        loss = model(input_ids=ids, labels=torch.roll(ids, -1, dims=1)).loss
        loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


def test_per_layer_expands_pairs():
    assert per_layer(parse_layer_policies("full-offload=1,full-paired=5")) == [
        "full-offload", "full", "chained", "full", "chained", "full"]


@pytest.mark.parametrize("runs", ["full-paired=5", "full-offload=1,full-paired=4",
                                  "remat-offload=1,full=1,full-paired=3"])
def test_paired_layers_match_no_checkpointing(base_model, runs):
    seed = int(torch.randint(0, 1 << 30, ()))
    kinds = per_layer(parse_layer_policies(runs))
    ref_loss, ref_grads = _step(copy.deepcopy(base_model), seed, steps=2)
    model = copy.deepcopy(base_model)
    apply_tiling(model, 13)
    assert apply_checkpointing(model, "auto", layer_policies=kinds, offload_min_bytes=0) == 5
    with AttentionCounter() as counter:
        loss, grads = _step(model, seed, steps=2)  # two backwards: every pair rebuilds once each
    full = sum(k.startswith("full") or k == "chained" for k in kinds)
    assert counter.total == 2 * (5 + full + kinds.count("chained"))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-11, atol=1e-13, msg=name)


def test_the_upper_layer_of_a_pair_keeps_no_input(base_model):
    model = copy.deepcopy(base_model)
    apply_checkpointing(model, "auto", layer_policies=per_layer((("full-paired", 4),
                                                                 ("full", 1))))
    inputs = {}

    def keep(i, args):
        inputs.setdefault(i, weakref.ref(args[0]))

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda mod, args, i=i: keep(i, args))
    ids = torch.randint(0, 83, (1, 40))
    loss = model(input_ids=ids, labels=ids).loss
    alive = [inputs[i]() is not None for i in range(5)]
    assert alive == [True, False, True, False, True]  # the chained layers' inputs are gone
    loss.backward()
    with pytest.raises(RuntimeError, match="asked for twice"):  # nothing kept for a 2nd time
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()


def test_a_chained_layer_needs_a_full_layer_below(base_model):
    model = copy.deepcopy(base_model)
    for kinds in (["chained", "full", "full", "full", "full"],
                  ["remat", "chained", "full", "full", "full"],
                  ["full-offload", "chained", "full", "full", "full"]):
        with pytest.raises(UserError, match="must follow a full layer"):
            apply_checkpointing(model, "auto", layer_policies=kinds)


def _run_both(rank, world, cfgs):
    import json
    from pathlib import Path

    from lctrain.train.runner import run_worker

    out = []
    for cfg in cfgs:
        assert run_worker(cfg) == 0
        path = Path(cfg.train.output_dir) / "metrics.jsonl"
        out.append([json.loads(line) for line in path.read_text().splitlines()])
    return out


def test_paired_layers_train_like_full_ones_under_fsdp2_on_two_ranks(tmp_path):
    """A real run (cp 2 over gloo, FSDP2, the tiny recipe's two layers as one pair): the same
    losses as full checkpointing, and one more attention forward per step for the pair."""
    from lctrain.config import load_recipe
    from spawn import run_on_ranks

    def cfg(name, runs):
        sets = {"data.seq_len": 128, "data.max_documents": 24, "train.max_steps": 3,
                "train.warmup_steps": 1, "train.loss_chunk_tokens": 48, "train.lr": 3e-3,
                "parallel.attention_backend": "reference", "parallel.cp": 2,
                "parallel.fsdp": "on", "checkpoint.export_final": False,
                "train.checkpointing": "auto", "train.layer_policies": runs}
        return load_recipe(None, [f"{k}={v}" for k, v in sets.items()],
                           output_dir=str(tmp_path / name))

    full, paired = run_on_ranks(_run_both, 2, [cfg("full", "full=2"),
                                               cfg("paired", "full-paired=2")])[0]
    assert [r["loss"] for r in paired] == [r["loss"] for r in full]  # the same computation
    assert paired[0]["attention_forward_calls"] == full[0]["attention_forward_calls"] + 1


def test_the_rebuild_runs_under_the_forwards_autocast():
    """The lower layer's forward is run again under the autocast state its first run had (the
    backward itself runs outside autocast): the rebuilt input equals the forward's bit for bit."""
    from torch.utils.checkpoint import noop_context_fn

    from lctrain.parallel.pairs import PairLink

    lower = torch.nn.Linear(16, 16)
    link = PairLink(lower)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = link.lower_checkpoint(noop_context_fn, lower, x)
    assert out.dtype == torch.bfloat16
    rebuilt = link.rebuild()  # outside autocast, as in the backward
    assert rebuilt.dtype == torch.bfloat16 and torch.equal(rebuilt, out.detach())


@pytest.mark.gpu
def test_paired_layers_on_a_gpu(base_model):
    """On a GPU in bf16: pairs give full checkpointing's loss and gradients."""
    seed = int(torch.randint(0, 1 << 30, ()))
    results = []
    for runs in ("full=5", "full-paired=5"):
        model = copy.deepcopy(base_model).to(device="cuda", dtype=torch.bfloat16)
        apply_checkpointing(model, "auto", layer_policies=per_layer(parse_layer_policies(runs)))
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 83, (2, 64), generator=g).cuda()
        loss = model(input_ids=ids, labels=torch.roll(ids, -1, dims=1)).loss
        loss.backward()
        results.append((loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad
                                         for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-2, atol=1e-4, msg=name)
