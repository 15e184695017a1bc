"""One training step's gradients with context parallelism == one process, in fp32.

Two gloo ranks hold the two halves (distflash layout) of one packed sequence with documents
(with FSDP2 also with the attention's projections in head groups); the
loop's `accumulate_gradients` divides each rank's summed loss by the GLOBAL label count and the
parallel strategy sums gradients over ranks. Both strategies — replication with an all-reduce,
and FSDP2 (which averages by default and must be made to sum) — must give exactly the gradients
of the mean token loss computed on one process.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lctrain.data import PackedBatch
from lctrain.model import CPContext, load_model
from lctrain.train.loop import CausalLMLoss
from spawn import run_on_ranks

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "vocab_size": 97, "max_position_embeddings": 512}
SEQ = 96
DOCS = (0, 30, 71, 96)


def _batch() -> PackedBatch:
    ids = torch.randint(0, TINY["vocab_size"], (1, SEQ))
    labels, positions = torch.full_like(ids, -100), torch.zeros_like(ids)
    for a, b in zip(DOCS[:-1], DOCS[1:]):
        labels[0, a:b - 1] = ids[0, a + 1:b]  # shifted before any sharding; -100 at doc ends
        positions[0, a:b] = torch.arange(b - a)
    labels[0, 5:9] = -100  # a few more ignored tokens
    return PackedBatch(ids, labels, positions, DOCS)


def _grads_on_ranks(rank, world, batch):
    got = {strategy: _one_step_grads(world, batch, strategy) for strategy in ("replicate", "fsdp")}
    got["fsdp, projections in 2 head groups"] = _one_step_grads(world, batch, "fsdp", groups=2)
    return got


def _one_step_grads(world, batch, strategy, groups=1):
    from accelerate import Accelerator

    from lctrain.model.grouped_attention import apply_grouped_attention
    from lctrain.model.structure import decoder_layers
    from lctrain.parallel import build_mesh, distribute
    from lctrain.parallel.context import ContextParallel
    from lctrain.train.loop import Trainer
    from lctrain.train.optim import build_optimizer

    pmesh = build_mesh(cp=world, device_type="cpu")
    cp = ContextParallel(pmesh, "distflash", "reference", device=torch.device("cpu"),
                         head_groups=groups)
    model = load_model(None, config=TINY, seed=0, attn_implementation=cp.attention)
    assert apply_grouped_attention(model, groups) == (2 if groups > 1 else 0)
    module = CausalLMLoss(model, chunk_tokens=40)
    dist = distribute(module, decoder_layers(model), world_mesh=pmesh.world_mesh,
                      strategy=strategy, param_dtype=None)
    optimizer, scheduler = build_optimizer(module, lr=1e-3, weight_decay=0.0, warmup_steps=0,
                                           total_steps=1, min_lr_ratio=0.1)
    trainer = Trainer(distributed=dist, optimizer=optimizer, scheduler=scheduler, pmesh=pmesh,
                      cp=cp, accelerator=Accelerator(cpu=True), grad_accum=1, max_grad_norm=0.0)
    stats = trainer.accumulate_gradients([batch])
    dist.sync_gradients()
    norm = dist.clip_grad_norm(None)
    grads = {}
    for name, p in module.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.replace("._checkpoint_wrapped_module", "")] = g.detach().numpy().copy()
    return grads, float(stats["count"]), float(norm)


def test_one_step_gradients_cp2_match_single_process():
    batch = _batch()
    module = CausalLMLoss(load_model(None, config=TINY, seed=0), chunk_tokens=40)
    count = int((batch.labels != -100).sum())
    ctx = CPContext(cu_seqlens=batch.cu_seqlens, backend="reference")
    loss = module(batch.input_ids, batch.labels, batch.position_ids, cp_context=ctx) / count
    loss.backward()
    want = {n: p.grad.numpy() for n, p in module.named_parameters()}
    want_norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten()
                                                          for p in module.parameters()])))
    for per_strategy in run_on_ranks(_grads_on_ranks, 2, batch):
        for strategy, (grads, got_count, norm) in per_strategy.items():
            assert got_count == count
            assert abs(norm - want_norm) <= 1e-5 * want_norm
            for name, g in want.items():
                np.testing.assert_allclose(grads[name], g, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{strategy}: {name}")


def _host_probe_reads(rank, world, batch):
    from accelerate import Accelerator

    from lctrain.model.structure import decoder_layers
    from lctrain.parallel import build_mesh, distribute
    from lctrain.parallel.context import ContextParallel
    from lctrain.train.loop import Trainer
    from lctrain.train.optim import build_optimizer

    pmesh = build_mesh(cp=world, device_type="cpu")
    cp = ContextParallel(pmesh, "distflash", "reference", device=torch.device("cpu"))
    module = CausalLMLoss(load_model(None, config=TINY, seed=0, attn_implementation=cp.attention),
                          chunk_tokens=40)
    dist = distribute(module, decoder_layers(module.model), world_mesh=pmesh.world_mesh,
                      strategy="replicate", param_dtype=None)
    optimizer, scheduler = build_optimizer(module, lr=1e-3, weight_decay=0.0, warmup_steps=0,
                                           total_steps=2, min_lr_ratio=0.1)
    grad_bytes = lambda: sum(p.grad.nbytes for p in module.parameters()  # noqa: E731
                             if p.grad is not None)
    trainer = Trainer(distributed=dist, optimizer=optimizer, scheduler=scheduler, pmesh=pmesh,
                      cp=cp, accelerator=Accelerator(cpu=True), grad_accum=1, max_grad_norm=0.0,
                      host_probe=grad_bytes)
    trainer.train_step([batch])
    return trainer.host_peak, grad_bytes()


def test_the_host_probe_reads_while_the_gradients_are_held():
    """A step's host reading is taken before its gradients are dropped (with FSDP2's CPU
    offload they live on the host during the step; a reading after it would miss them)."""
    peak, after = run_on_ranks(_host_probe_reads, 1, _batch())[0]
    params = TINY["vocab_size"] * TINY["hidden_size"] * 2  # at least the embeddings' gradients
    assert after == 0 and peak >= 4 * params



SHORT = 32  # tokens a row in the dp × cp × grad_accum steps below
BOUNDS = ((0, 8, 32), (0, 3, 32), (0, 20, 26, 32), (0, 10, 21, 32))
"""Documents of the rows: the cp ranks' attention work is even in rows 0 and 2, not in 1 and 3."""


def _uneven_rows() -> list[PackedBatch]:
    """Packed rows with very different numbers of labelled tokens (one with none at all)."""
    keep = (SHORT - 2, 3, 0, 17)
    rows = []
    for bounds, kept in zip(BOUNDS, keep):
        ids = torch.randint(0, TINY["vocab_size"], (1, SHORT))
        labels, positions = torch.full_like(ids, -100), torch.zeros_like(ids)
        for a, b in zip(bounds[:-1], bounds[1:]):
            labels[0, a:b - 1] = ids[0, a + 1:b]
            positions[0, a:b] = torch.arange(b - a)
        labelled = (labels[0] != -100).nonzero().flatten()
        labels[0, labelled[torch.randperm(len(labelled))[kept:]]] = -100
        rows.append(PackedBatch(ids, labels, positions, bounds))
    return rows


def _full_steps(rank, world, steps, settings):
    """`run_loop` over ``steps`` (each: the global rows) on dp 2 × cp 2 with grad_accum 2, with
    each parallel strategy: the records, each step's gradients as AdamW got them, the weights
    after, and this rank's attention balance of each step."""
    return {strategy: _run_steps(steps, settings, strategy) for strategy in ("replicate", "fsdp")}


def _run_steps(steps, settings, strategy):
    from accelerate import Accelerator

    from lctrain.model.flops import FlopModel
    from lctrain.model.structure import decoder_layers
    from lctrain.parallel import build_mesh, distribute
    from lctrain.parallel.context import ContextParallel
    from lctrain.train.loop import LoopHooks, Trainer, run_loop
    from lctrain.train.optim import build_optimizer

    pmesh = build_mesh(cp=2, device_type="cpu")
    cp = ContextParallel(pmesh, "distflash", "reference", device=torch.device("cpu"), balance=True)
    module = CausalLMLoss(load_model(None, config=TINY, seed=0, attn_implementation=cp.attention),
                          chunk_tokens=24)
    dist = distribute(module, decoder_layers(module.model), world_mesh=pmesh.world_mesh,
                      strategy=strategy, param_dtype=None)
    optimizer, scheduler = build_optimizer(
        module, lr=settings["lr"], weight_decay=settings["weight_decay"], eps=settings["eps"],
        warmup_steps=settings["warmup"], total_steps=settings["total"],
        min_lr_ratio=settings["min_lr_ratio"])
    trainer = Trainer(distributed=dist, optimizer=optimizer, scheduler=scheduler, pmesh=pmesh,
                      cp=cp, accelerator=Accelerator(cpu=True), grad_accum=2,
                      max_grad_norm=settings["max_grad_norm"])
    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    def named():  # the names of the plain model's parameters
        return ((n.replace("._checkpoint_wrapped_module", "").removeprefix("model."), p)
                for n, p in module.named_parameters())
    grads, balances = [], []

    def record(*_):
        grads.append({n: full(p.grad).numpy() for n, p in named()})
        balances.append(trainer.work_balance)

    optimizer.register_step_pre_hook(record)
    mine = (b for rows in steps for b in rows[pmesh.dp_rank::pmesh.dp])  # as iter_batches deals
    hooks = LoopHooks(max_steps=len(steps), checkpoint_every=0, tokens_per_step=4 * SHORT,
                      flops=FlopModel(1.0, 1.0), peak_flops=None, log=lambda record: None,
                      progress=lambda step, record: None, save=None)
    records = run_loop(trainer, mine, hooks)
    return records, grads, {n: full(p).numpy() for n, p in named()}, balances


def _reference_steps(steps, settings):
    """The same steps in float64 on one process with plain transformers (eager attention, each
    document on its own): summed token losses over the global batch ÷ its label count, torch's
    clipping, AdamW with weight decay on matrices only, at the documented warm-up/cosine rate."""
    import math

    model = load_model(None, config=TINY, seed=0, attn_implementation="eager").double()
    params = list(model.named_parameters())
    groups = [{"params": [p for _, p in params if p.ndim >= 2],
               "weight_decay": settings["weight_decay"]},
              {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=settings["lr"], betas=(0.9, 0.95),
                                  eps=settings["eps"], foreach=False)
    warmup, total, floor = settings["warmup"], settings["total"], settings["min_lr_ratio"]
    records, grads = [], []
    for i, rows in enumerate(steps):
        ratio = ((i + 1) / warmup if i < warmup else floor + (1 - floor) * 0.5 * (
            1 + math.cos(math.pi * (i - warmup) / (total - warmup))))
        for group in optimizer.param_groups:
            group["lr"] = settings["lr"] * ratio
        loss, count = 0.0, 0
        for row in rows:
            for a, b in zip(row.cu_seqlens[:-1], row.cu_seqlens[1:]):
                labels = row.labels[:, a:b]
                logits = model(input_ids=row.input_ids[:, a:b]).logits  # (1, b - a, V)
                loss = loss + torch.nn.functional.cross_entropy(
                    logits[0], labels[0], ignore_index=-100, reduction="sum")
                count += int((labels != -100).sum())
        optimizer.zero_grad()
        (loss / count).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings["max_grad_norm"])
        grads.append({n: p.grad.numpy().copy() for n, p in params})
        records.append({"loss": loss.item() / count, "grad_norm": norm.item(),
                        "lr": settings["lr"] * ratio})
        optimizer.step()
    return records, grads, {n: p.detach().numpy() for n, p in params}


def test_full_steps_with_dp_cp_and_grad_accum_match_one_float64_process():
    """Two optimizer steps on dp 2 × cp 2 with grad_accum 2, micro-batches holding very different
    numbers of labelled tokens (one none): the logged loss, gradient norm and rate, the clipped
    gradients AdamW gets and the weights after are those of one float64 process training on the
    whole global batch; the logged attention balance is the busiest cp group's, whichever dp
    rank holds it (rank 0 logs)."""
    settings = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3, "warmup": 1, "total": 3,
                "min_lr_ratio": 0.2, "max_grad_norm": 0.5}
    rows = _uneven_rows()
    steps = [rows, rows[::-1]]  # dp rank 0 holds the even rows first, then the uneven ones
    want_records, want_grads, want_weights = _reference_steps(steps, settings)
    assert want_records[0]["grad_norm"] > settings["max_grad_norm"]  # clipping is at work
    per_rank = run_on_ranks(_full_steps, 4, steps, settings)
    for rank, per_strategy in enumerate(per_rank):
        for strategy, (records, grads, weights, _) in per_strategy.items():
            where = f"{strategy}, rank {rank}"
            for record, want in zip(records, want_records, strict=True):
                assert record["loss"] == pytest.approx(want["loss"], rel=1e-5), where
                assert record["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), where
                assert record["lr"] == pytest.approx(want["lr"], rel=1e-12), where
            for got, want in zip(grads, want_grads, strict=True):
                for name, g in want.items():
                    np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-7,
                                               err_msg=f"{where}: {name}")
            for name, w in want_weights.items():
                np.testing.assert_allclose(weights[name], w, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{where}: {name}")
    busiest = [max(balances) for balances in zip(*(r["replicate"][3] for r in per_rank))]
    assert busiest[0] > 1.01 and busiest[1] > 1.01  # on dp rank 1 first, then on dp rank 0
    for strategy in ("replicate", "fsdp"):
        logged = [record["attention_balance"] for record in per_rank[0][strategy][0]]
        assert logged == pytest.approx(busiest, rel=1e-12), strategy
