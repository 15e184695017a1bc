"""The analytic memory model: parameter counts, monotonicity, policies, cp, JSON, recipes."""
import json

import pytest

from lctrain.config import LayerPlan, load_recipe
from lctrain.errors import UserError
from lctrain.memory import (
    HOST_USABLE,
    PRESETS,
    estimate,
    estimate_recipe,
    from_config_dict,
    load_architecture,
)

GIB = 1 << 30
PARKED = LayerPlan.parse("remat", "layers")
POLICIES = {"none": "none", "full": "full", "remat": "remat", "parked": PARKED}


@pytest.mark.parametrize("name, billions", [("llama-7b", 6.74), ("llama3-8b", 8.03),
                                            ("mistral-7b", 7.24), ("qwen2.5-7b", 7.62)])
def test_preset_parameter_counts(name, billions):
    assert abs(load_architecture(name).parameters() / 1e9 - billions) <= 0.01


def test_llama_7b_exact_count():
    assert load_architecture("llama-7b").parameters() == 6_738_415_616


@pytest.mark.parametrize("fields", [
    {"model_type": "llama", "num_key_value_heads": 2, "tie_word_embeddings": True},
    {"model_type": "llama", "num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
    {"model_type": "llama", "head_dim": 24},
    {"model_type": "qwen2", "num_key_value_heads": 2},
])
def test_formula_matches_transformers_models(fields):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = {"vocab_size": 301, "hidden_size": 64, "intermediate_size": 112,
            "num_hidden_layers": 3, "num_attention_heads": 4}
    config = {**base, **fields}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**{k: v for k, v in config.items()}))
    assert from_config_dict(config).parameters() == sum(p.numel() for p in model.parameters())


def test_monotonic_in_seq_len():
    arch = load_architecture("llama-7b")
    for policy in POLICIES.values():
        runs = [estimate(arch, s, 8, 2, policy) for s in (4096, 16384, 65536, 262144, 524288)]
        totals = [r.per_gpu_bytes["total"] for r in runs]
        saved = [r.details["saved_activations"] for r in runs]
        assert totals == sorted(totals) and totals[-1] > totals[0], policy
        assert saved == sorted(saved) and len(set(saved)) == len(saved), policy


def test_policies_order_activations():
    arch = load_architecture("llama3-8b")
    saved = {p: estimate(arch, 131072, 8, 4, v).details["saved_activations"]
             for p, v in POLICIES.items()}
    assert saved["parked"] < saved["full"] < saved["remat"] < saved["none"]
    host = {p: estimate(arch, 131072, 8, 4, v).details["host_offload"] for p, v in POLICIES.items()}
    assert host["parked"] == 32 * (131072 // 4) * (2 * 4096 * 2 + 4 * 32)  # input, out, lse
    assert host["none"] == host["full"] == host["remat"] == 0
    # remat keeps exactly the attention output (bf16) and fp32 lse per layer beyond full
    extra = 32 * (131072 // 4) * (2 * 4096 + 4 * 32)
    assert saved["remat"] - saved["full"] == extra


def test_cp_halves_activations():
    arch = load_architecture("mistral-7b")
    for policy in POLICIES.values():
        one = estimate(arch, 65536, 4, 1, policy).details["saved_activations"]
        two = estimate(arch, 65536, 4, 2, policy).details["saved_activations"]
        assert 2 * two == one, policy


def test_fsdp_shards_parameters_and_optimizer():
    arch = load_architecture("llama-7b")
    one = estimate(arch, 4096, 1, 1, "full", master_dtype="float32")
    eight = estimate(arch, 4096, 8, 1, "full", master_dtype="float32")
    assert one.per_gpu_bytes["parameters"] == 4 * arch.parameters()
    assert eight.per_gpu_bytes["parameters"] == -(-4 * arch.parameters() // 8)
    assert eight.per_gpu_bytes["optimizer"] == 2 * eight.per_gpu_bytes["parameters"]


def test_json_fields_and_total():
    est = estimate(load_architecture("qwen2.5-7b"), 32768, 8, 2, "remat", gpu_memory=80 * GIB)
    data = json.loads(json.dumps(est.to_json()))
    assert data["parameters_count"] == load_architecture("qwen2.5-7b").parameters()
    parts = data["per_gpu_bytes"]
    assert set(parts) == {"parameters", "gradients", "optimizer", "activations", "other", "total"}
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert isinstance(data["fits"], bool) and data["max_seq_len"] % 2 == 0


def test_max_seq_len_is_the_boundary():
    arch = load_architecture("llama-7b")
    est = estimate(arch, 8192, 8, 4, "remat", gpu_memory=80 * GIB, seq_chunks=8)
    longest = est.max_seq_len
    assert longest > 8192 and longest % 8 == 0 and est.fits
    assert estimate(arch, longest, 8, 4, "remat").per_gpu_bytes["total"] <= 80 * GIB
    assert estimate(arch, longest + 8, 8, 4, "remat").per_gpu_bytes["total"] > 80 * GIB
    tiny_gpu = estimate(arch, 8192, 8, 4, "remat", gpu_memory=GIB)
    assert tiny_gpu.fits is False and tiny_gpu.max_seq_len == 0


def test_host_memory_bounds_parked_layers():
    """2 x H200 with 251 GiB of host memory: 512K does not fit the HOST (measured: the workers
    were OOM-killed), and the longest length is where the machine's pinned bytes meet it."""
    arch, host, gpus = load_architecture("llama-7b"), 251 * GIB, int(torch_randint(1, 3)) * 2
    kw = dict(gpu_memory=139 * GIB, seq_chunks=2, host_memory=host, gpus_per_node=gpus)
    est = estimate(arch, 512 * 1024, gpus, 2, PARKED, **kw)
    assert est.fits is False and est.details["host_offload_per_node"] > HOST_USABLE * host
    longest = est.max_seq_len
    assert 0 < longest < 512 * 1024 and longest % 2 == 0

    def pinned(seq):
        return estimate(arch, seq, gpus, 2, PARKED).details["host_offload"] * gpus

    assert pinned(longest) <= HOST_USABLE * host < pinned(longest + 2)
    assert estimate(arch, longest, gpus, 2, PARKED, **kw).fits
    remat = estimate(arch, 512 * 1024, gpus, 2, "remat", **kw)  # nothing pinned: GPU bound only
    assert remat.max_seq_len == estimate(arch, 512 * 1024, gpus, 2, "remat", gpu_memory=139 * GIB,
                                         seq_chunks=2).max_seq_len
    assert json.loads(json.dumps(est.to_json()))["host_memory"] == host


def torch_randint(low, high):
    import torch

    return torch.randint(low, high, ()).item()


def test_optimizer_phase_wins_at_short_context():
    est = estimate(load_architecture("llama-7b"), 256, 1, 1, "full", master_dtype="float32")
    assert est.details["phase"] == "optimizer"
    assert est.per_gpu_bytes["gradients"] == est.per_gpu_bytes["parameters"]


def test_a_first_step_peaks_before_adamw_makes_its_states():
    arch = load_architecture("llama-7b")
    long = estimate(arch, 262144, 2, 2, "remat", master_dtype="float32")
    assert long.details["phase"] == "activations"
    states = long.per_gpu_bytes["optimizer"]
    assert states > 0 and long.details["first_step_peak"] == long.details["peak_allocated"] - states
    # shorter: the update (gradients beside the states) outgrows the activations without them
    mid = estimate(arch, 65536, 2, 2, "remat", master_dtype="float32")
    assert mid.details["peak_allocated"] - states < mid.details["first_step_peak"] < mid.details[
        "peak_allocated"]
    short = estimate(arch, 256, 1, 1, "full", master_dtype="float32")  # the update's peak stays
    assert short.details["first_step_peak"] == short.details["peak_allocated"]


def test_recipe_estimate_uses_the_recipe(tmp_path):
    cfg = load_recipe("recipes/llama-7b-256k.yaml")
    est = estimate_recipe(cfg, seq_len=262144, gpus=2, gpu_memory=141 * GIB)
    assert est.policy == cfg.train.checkpointing and est.cp == cfg.parallel.cp
    assert est.details["offload"] == cfg.train.offload == "layers"
    assert est.parameters_count == load_architecture("llama-7b").parameters()
    assert est.master_dtype == cfg.model.dtype == "float32" and est.dtype == "bfloat16"  # bf16 compute
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PRESETS["llama3-8b"]))
    by_path = estimate_recipe(cfg, model=str(tmp_path), seq_len=262144, gpus=8,
                              gpu_memory=80 * GIB, cp=8, checkpointing="full")
    assert by_path.parameters_count == load_architecture("llama3-8b").parameters()
    bare = estimate_recipe(None, model="mistral-7b", seq_len=8192, gpus=8, gpu_memory=80 * GIB)
    assert bare.cp == 1 and bare.master_dtype == "float32"


@pytest.mark.parametrize("kwargs, words", [
    ({"model": "llama-9000"}, "neither a preset"),
    ({"model": "llama-7b", "cp": 3}, "cp that divides"),
    ({"model": "llama-7b", "seq_len": 1001, "cp": 2}, "multiple of 2"),
    ({"model": "llama-7b", "checkpointing": "sometimes"}, "runs such as"),
    ({"model": "llama-7b", "checkpointing": "remat=3"}, "covers 3 layers but the model has 32"),
])
def test_user_errors_are_one_sentence(kwargs, words):
    args = {"seq_len": 4096, "gpus": 4, "gpu_memory": 80 * GIB, **kwargs}
    with pytest.raises(UserError, match=words):
        estimate_recipe(None, **args)


def test_table_renders():
    from lctrain.memory import estimate_table
    from lctrain.report.table import render

    est = estimate(load_architecture("llama-7b"), 65536, 8, 2, "remat", gpu_memory=80 * GIB)
    text = render(estimate_table(est.to_json()), "table", terminal=True, width=80)
    assert "activations" in text and "fits" in text and "6.74 B" in text
    # the step time models dense rows; the table says packed documents train faster
    assert "step time (est.)" in text and "rows that are one document" in " ".join(text.split())
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("seq_len, tile", [(65536, 0), (131072, 8192)])
def test_unchecked_layers_on_top_cost_their_kept_tensors_not_a_remat_layers_backward(seq_len,
                                                                                     tile):
    """Remat layers below unchecked ones: the same estimate as uniform remat with none of them
    and as no checkpointing with all of them; each more one raises the peak, by at most what it
    keeps beyond remat — less (the first one nothing) while the peak is a remat layer's
    recompute, whose backward starts after the unchecked layers above have freed their
    tensors."""
    from lctrain.memory.activations import layer_saved, remat_kept

    arch = load_architecture("llama-7b")
    layers, c = arch.num_layers, 2

    def peak(policy):
        return estimate(arch, seq_len, 1, 1, policy, tile_tokens=tile).details["peak_allocated"]

    def runs(n):  # remat below, n unchecked on top
        return tuple((kind, k) for kind, k in (("remat", layers - n), ("none", n)) if k)

    peaks = [peak(LayerPlan().placed(runs(n), 0)) for n in range(layers + 1)]
    assert peaks[0] == peak("remat") and peaks[-1] == peak("none")
    extra = layer_saved(arch, seq_len, c, tile_tokens=tile) - remat_kept(arch, seq_len, c)
    steps = [b - a for a, b in zip(peaks, peaks[1:])]
    assert all(0 <= step <= extra for step in steps) and steps[-1] == extra
    assert steps[0] < extra  # the first one fits in what a remat layer's recompute needed
