"""The planner: the layer placement against brute force, the choices it makes in situations
whose answer is known, what its commands run, the published targets, the CLI."""
from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import shlex

import pytest
import torch
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import LayerPlan, load_recipe
from lctrain.memory import estimate, estimate_recipe, load_architecture
from lctrain.memory.activations import input_kept, kept_during_layers, remat_kept
from lctrain.memory.estimate import Setup, breakdown
from lctrain.memory.placement import place
from lctrain.memory.plan import Machine, fastest, longest
from lctrain.memory.recipe import plan_recipe

GIB = 1 << 30


def _split_bytes(arch, tokens, c, counts):
    """(most kept GPU bytes during the backward, host bytes) of a placement in the planner's
    order (parked full, parked remat, full, remat), walked as the offloader walks it."""
    big, small = remat_kept(arch, tokens, c), input_kept(arch, tokens, c)
    rg, rh, fg, fh = counts
    kept = [small] * fh + [big] * rh + [small] * fg + [big] * rg
    parked = [True] * (fh + rh) + [False] * (fg + rg)
    return max(kept_during_layers(kept, parked)), rh * big + fh * small


@pytest.mark.parametrize("trial", range(8))
def test_placement_keeps_the_most_attention_outputs_gpu_first(trial):
    """Brute force over every split of 6 layers into remat / full, kept on the GPU or parked:
    the placement keeps as many attention outputs as any placement that fits, and of those
    parks the fewest bytes in host memory, the parked layers lowest."""
    arch = dataclasses.replace(load_architecture("llama-7b"), num_layers=6)
    tokens, c = 4096, 2
    big = remat_kept(arch, tokens, c)
    import random

    rng = random.Random(int(__import__("torch").randint(0, 1 << 30, ())) + trial)
    gpu_room, host_room = rng.randrange(0, 9 * big), rng.randrange(0, 7 * big)
    feasible = []
    for rg, rh, fg in itertools.product(range(7), repeat=3):
        fh = 6 - rg - rh - fg
        if fh >= 0:
            gpu, host = _split_bytes(arch, tokens, c, (rg, rh, fg, fh))
            if gpu <= gpu_room and host <= host_room:
                feasible.append((rg, rh, fg, fh))
    found = place(arch, tokens, c, gpu_room, host_room)
    if not feasible:
        assert found is None
        return
    plan = LayerPlan().placed(*found)
    kinds, parked = plan.kinds(6), plan.parked_layers(6)
    got = tuple(sum(k == kind and p == hosted for k, p in zip(kinds, parked))
                for kind, hosted in (("remat", False), ("remat", True), ("full", False),
                                     ("full", True)))
    gpu, host = _split_bytes(arch, tokens, c, got)
    assert gpu <= gpu_room and host <= host_room and sum(got) == 6
    most_remat = max(rg + rh for rg, rh, _, _ in feasible)
    assert got[0] + got[1] == most_remat
    assert host == min(_split_bytes(arch, tokens, c, f)[1] for f in feasible
                       if f[0] + f[1] == most_remat)
    assert list(parked) == sorted(parked, reverse=True)  # the parked layers lowest
    order = [k for k, p in zip(kinds, parked) if p] + [k for k, p in zip(kinds, parked) if not p]
    assert order == ["full"] * got[3] + ["remat"] * got[1] + ["full"] * got[2] + ["remat"] * got[0]


def _base(model="llama-7b", gpus=2, **kw):
    return Setup(arch=load_architecture(model), gpus=gpus, cp=1, **kw)


def _chunks(cp):
    return cp


def test_with_room_to_spare_nothing_is_traded_for_memory():
    choice = fastest(_base(), Machine(2, 1 << 50, 1 << 50, 2), 4096, _chunks)
    s = choice.setup
    assert (s.cp, s.layers.checkpointing, s.tile_tokens, s.head_groups, s.layers.offload) == (
        1, "none", 0, 1, "none")


def test_none_then_remat_on_the_gpu_then_host_memory_then_recompute():
    """A 7B model (bf16 weights and states) on one 139 GiB GPU: short sequences keep every
    activation; then remat keeps the attention outputs on the GPU, the top layers whole where
    the peak leaves room; then some layers wait in host memory (copies overlap compute); without
    host memory, attention is recomputed."""
    machine = Machine(1, 139 * GIB, 251 * GIB, 1)
    base = _base(gpus=1, master_dtype="bfloat16")
    short = fastest(base, machine, 16 * 1024, _chunks).setup
    assert (short.layers.checkpointing, short.tile_tokens, short.head_groups) == ("none", 0, 1)
    remat = fastest(base, machine, 128 * 1024, _chunks).setup
    assert remat.layers.runs[0][0] == "remat" and remat.layers.parked == 0
    hosted = fastest(base, machine, 192 * 1024, _chunks)
    assert hosted.setup.layers.checkpointing == "remat" and hosted.setup.layers.parked > 0
    assert hosted.setup.layers.state == "none"
    no_host = fastest(base, dataclasses.replace(machine, host_memory=None), 192 * 1024, _chunks)
    assert {name for name, _ in no_host.setup.layers.runs} == {"remat", "full"}
    assert no_host.setup.layers.offload == "none"
    assert no_host.details["host_offload"] == 0 and no_host.step_s > hosted.step_s


def test_auto_keeps_the_top_layers_whole_while_the_peak_fits():
    """Where every layer fits remat on the GPU, ``auto`` keeps the most top layers whole (no
    recompute) whose peak, with the allocator's headroom, fits the GPU: one more would not."""
    gen = torch.Generator().manual_seed(torch.initial_seed())
    model = ["llama-7b", "llama3.1-8b"][int(torch.randint(2, (1,), generator=gen))]
    seq_len = 1024 * int(torch.randint(32, 129, (1,), generator=gen))
    gpu = 139 * GIB
    setup = Setup(arch=load_architecture(model), gpus=2, cp=2, layers=LayerPlan.parse("auto"),
                  gpu_memory=gpu)
    layers = setup.arch.num_layers

    def plan(whole: int) -> LayerPlan:
        return LayerPlan.parse(f"remat={layers - whole},none={whole}" if whole < layers else "none")

    placed = LayerPlan.parse(breakdown(setup, seq_len)[1]["checkpointing"])
    whole = placed.kinds(layers).count("none")
    assert placed.kinds(layers) == plan(whole).kinds(layers) and placed.parked == 0

    def total(whole: int) -> int:
        return breakdown(dataclasses.replace(setup, layers=plan(whole)), seq_len)[0]["total"]

    assert total(whole) <= gpu and (whole == layers or total(whole + 1) > gpu), (model, seq_len)


def test_choices_are_what_their_commands_run(tmp_path):
    """Each choice's --set items make a recipe whose estimate (runs and parked layers given) is
    the planned one, within the GPU and the host budget; one length further no option fits."""
    gpu, host = 139 * GIB, 251 * GIB
    plan = plan_recipe(load_recipe("llama-7b-256k"), gpus=2, gpu_memory=gpu, host_memory=host,
                       seq_len=512 * 1024)
    for name in ("longest", "fastest"):
        choice = plan[name]
        cfg = load_recipe("llama-7b-256k", choice["overrides"], seq_len=choice["seq_len"])
        est = estimate_recipe(cfg, seq_len=choice["seq_len"], gpus=2, gpu_memory=gpu,
                              host_memory=host, gpus_per_node=2)
        assert est.per_gpu_bytes == choice["per_gpu_bytes"] and est.fits
        assert est.details["host_offload"] == choice["host_offload"]
    best = plan["longest"]
    assert best["seq_len"] > 1 << 20 and best["seq_len"] % 1024 == 0
    beyond = plan_recipe(load_recipe("llama-7b-256k"), gpus=2, gpu_memory=gpu, host_memory=host,
                         seq_len=best["seq_len"] + 64 * 1024)
    assert beyond["fastest"] is None


@pytest.mark.parametrize("model, gpus, host, dtype, at_least", [
    ("llama-7b", 2, 251, "float32", 1 << 20),      # 2 x H200: >= 1M
    ("llama3-8b", 1, 128, "float32", 500 * 1024),  # 1 x H200 with 128 GiB: >= 500K
    ("llama3-8b", 1, 128, "bfloat16", 512 * 1024),  # ... and with bf16 weights and states
    ("llama3-8b", 1, 1024, "float32", 1_200_000),  # ALST's host: 1.2M on one H200
])
def test_targets(model, gpus, host, dtype, at_least):
    best = longest(_base(model, gpus, master_dtype=dtype),
                   Machine(gpus, 139 * GIB, host * GIB, gpus), _chunks)
    assert best.seq_len >= at_least
    layers = best.setup.layers
    assert not layers.auto and layers.parked_layers(32)[:layers.parked or 32] == (True,) * (
        layers.parked or 32)  # the lowest layers parked
    est = estimate(best.setup.arch, best.seq_len, gpus, best.setup.cp, layers,
                   master_dtype=dtype, gpu_memory=139 * GIB, host_memory=host * GIB,
                   tile_tokens=best.setup.tile_tokens, head_groups=best.setup.head_groups)
    assert est.fits


def test_cli_plan_table_commands_and_json():
    runner = CliRunner()
    args = ["estimate-memory", "--model", "llama-7b", "--plan", "--seq-len", "256k", "--gpus", "2",
            "--gpu-memory", "139GiB", "--host-memory", "251GiB"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "fastest at 256K" in result.output and "lctrain finetune --seq-len" in result.output
    data = json.loads(runner.invoke(app, [*args, "--json"]).output)
    line = next(ln.strip() for ln in result.output.splitlines() if "--seq-len 256k" in ln)
    sets = [a for i, a in enumerate(shlex.split(line)) if shlex.split(line)[i - 1] == "--set"]
    fastest_choice = data["fastest"]
    assert f"train.checkpointing={fastest_choice['checkpointing']}" in sets
    assert f"train.offload={fastest_choice['offload']}" in sets
    row = next(ln for ln in result.output.splitlines() if ln.startswith("checkpointing"))
    assert fastest_choice["checkpointing"] in row  # the table prints the parsed form too
    assert data["fastest"]["seq_len"] == 256 * 1024 and data["longest"]["seq_len"] > 1 << 20
    bad = runner.invoke(app, [*args, "--cp", "2"])
    assert bad.exit_code != 0 and "--plan chooses cp" in bad.output
    as_csv = runner.invoke(app, [*args, "--format", "csv"])  # the CSV alone on stdout
    rows = list(csv.reader(io.StringIO(as_csv.stdout)))
    assert as_csv.exit_code == 0 and len({len(r) for r in rows}) == 1 and len(rows) > 5
    assert "lctrain finetune --seq-len" in as_csv.stderr


def test_a_plan_for_short_documents_chooses_what_was_measured_fastest():
    """On 2 × H200 at 128K, documents of median 4K ran fastest at cp 2 with whole top layers,
    and the plan's dense choice (cp 1) was slower (benchmarks/results/h200x2/
    step-whole-layers.json); with --documents the plan counts the pairs inside documents and
    chooses cp 2, the memory unchanged."""
    runner = CliRunner()
    args = ["estimate-memory", "llama3.1-8b-random-128k", "--plan", "--seq-len", "128k",
            "--gpus", "2", "--gpu-memory", "139GiB", "--host-memory", "251GiB", "--json"]
    dense = json.loads(runner.invoke(app, args).output)
    mixed = json.loads(runner.invoke(app, [*args, "--documents", "lognormal:median=4k"]).output)
    assert dense["fastest"]["cp"] == 1 and mixed["fastest"]["cp"] == 2
    assert 0.05 < mixed["attended"] < 0.2 and dense["attended"] == 1.0
    assert mixed["longest"] == dense["longest"]  # the longest is planned for one document
    assert mixed["fastest"]["step_s"] < dense["fastest"]["step_s"] / 2


def test_documents_scale_the_attention_of_the_step_time_only():
    from lctrain.bench.documents import attended_share

    assert attended_share("8x8k", 65536) == pytest.approx(8 * 8192 ** 2 / 65536 ** 2)
    cfg = load_recipe("llama-7b-256k", ["data.document_mask=true"], seq_len=131072)
    one, eighth = (estimate_recipe(cfg, seq_len=131072, gpus=2, gpu_memory=139 << 30,
                                   attended=share) for share in (1.0, 1 / 8))
    assert one.per_gpu_bytes == eighth.per_gpu_bytes
    linear = 2 * estimate_recipe(cfg, seq_len=131072, gpus=2, gpu_memory=139 << 30,
                                 attended=0.5).details["step_seconds"] - one.details["step_seconds"]
    assert eighth.details["step_seconds"] == pytest.approx(  # attention is linear in the share
        linear + (one.details["step_seconds"] - linear) / 8)
    result = CliRunner().invoke(app, ["estimate-memory", "--model", "llama-7b", "--plan",
                                      "--documents", "8x8k"])
    assert result.exit_code != 0 and "--documents times the fastest settings at --seq-len" in \
        result.output
    result = CliRunner().invoke(app, ["estimate-memory", "llama-7b-256k", "--seq-len", "64k",
                                      "--documents", "9x8k"])
    assert result.exit_code != 0 and "--documents" in result.output
    result = CliRunner().invoke(app, ["estimate-memory", "llama-7b-256k", "--seq-len", "64k",
                                      "--set", "data.document_mask=false", "--documents", "8x8k"])
    assert result.exit_code != 0 and "add --set data.document_mask=true" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("extra, words", [
    (["--set", "parallel.schedule=zigzag", "--seq-len", "100001"], "such as 100000 or 100002"),
    (["--seq-len", "1"], "sequence length 1 is too short to train"),
    (["--gpus-per-node", "4", "--host-memory", "251GiB"], "--gpus-per-node 4 is more than the 2"),
])
def test_a_plan_nothing_could_run_is_an_error(extra, words):
    """A length no cp cuts into the layout's chunks (not one that "does not fit" beside a longer
    one that does), a length the recipe refuses (no command that fails), more GPUs per machine
    than the job has (not a plan on a machine estimate-memory refuses): one error sentence."""
    args = ["estimate-memory", "llama-7b-256k", "--plan", "--gpus", "2", "--gpu-memory", "139GiB"]
    result = CliRunner().invoke(app, [*args, *extra])
    assert result.exit_code != 0 and words in result.output, result.output
    assert "Traceback" not in result.output and "lctrain finetune" not in result.output


def test_tokens_per_second_count_every_micro_batch_of_a_step():
    """A step of grad_accum 4 trains four rows per GPU group in (about) four times the time:
    its tokens/s is that of grad_accum 1, not a quarter of it."""
    runs = {}
    for accum in (1, 4):
        plan = plan_recipe(load_recipe("llama-7b-256k", [f"train.grad_accum={accum}"]), gpus=2,
                           gpu_memory=139 * GIB, host_memory=None, seq_len=64 * 1024)
        runs[accum] = choice = plan["fastest"]
        assert choice["tokens_per_s"] * choice["step_s"] == pytest.approx(
            choice["seq_len"] * choice["dp"] * accum)
    assert runs[4]["tokens_per_s"] == pytest.approx(runs[1]["tokens_per_s"], rel=0.05)


@pytest.mark.parametrize("gpu", [48, 80])
def test_without_fsdp_no_choice_keeps_the_state_on_the_host(gpu):
    """train.offload=state is FSDP2's CPU offload, which the recipe refuses with parallel.fsdp
    off: the plan never chooses it there, and every command it prints loads."""
    sets = ["parallel.fsdp=off"]
    plan = plan_recipe(load_recipe("llama-7b-256k", sets), gpus=2, gpu_memory=gpu * GIB,
                       host_memory=1024 * GIB, seq_len=64 * 1024)
    for choice in filter(None, (plan["longest"], plan["fastest"])):
        assert "state" not in choice["offload"].split(",")
        load_recipe("llama-7b-256k", [*sets, *choice["overrides"]], seq_len=choice["seq_len"])
    assert (plan["longest"] is None) == (gpu == 48)  # without FSDP2 the whole state stays on


def test_cp_sizes_are_every_divisor_found_quickly():
    """The planner tries each divisor of the GPU count as cp; found up to √n, so a job of a
    billion GPUs is planned in seconds, not a loop over every count."""
    import random
    import time

    from lctrain.memory.estimate import divisors

    for n in [1, 2, 16, 36, 97, 5040, *random.sample(range(1, 20_000), 50)]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    start = time.perf_counter()
    assert divisors(10**12) == sorted({2**a * 5**b for a in range(13) for b in range(13)})
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("recipe, preset", [("tiny", "llama-7b"), ("llama-7b-256k", "qwen2.5-7b")])
def test_a_plan_for_a_recipe_and_a_preset_prints_commands_that_train_the_preset(recipe, preset):
    from lctrain.config import load_recipe
    from lctrain.memory import recipe_architecture
    from lctrain.memory.arch import from_config_dict
    from lctrain.memory.presets import PRESETS

    result = CliRunner().invoke(app, ["estimate-memory", recipe, "--model", preset, "--plan",
                                      "--seq-len", "64k", "--gpus", "2"])
    assert result.exit_code == 0, result.output
    line = next(ln.strip() for ln in result.output.splitlines() if "--seq-len 64k" in ln)
    words = shlex.split(line)
    sets = [w for i, w in enumerate(words) if words[i - 1] == "--set"]
    cfg = load_recipe(recipe, sets, seq_len="64k")
    assert recipe_architecture(cfg) == from_config_dict(PRESETS[preset])
