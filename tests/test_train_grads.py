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


SHORT = 32  # tokens a row in the dp × cp × grad_accum step below


def _uneven_rows(n_rows: int) -> list[PackedBatch]:
    """Rows of one position run each, with very different numbers of labelled tokens."""
    keep = (SHORT - 1, 3, 17, 0, 9, 25, 1, 12)[:n_rows]  # a row with no label at all too
    rows = []
    for i in range(n_rows):
        ids = torch.randint(0, TINY["vocab_size"], (1, SHORT))
        labels = torch.full_like(ids, -100)
        labels[0, :SHORT - 1] = ids[0, 1:]
        drop = torch.randperm(SHORT - 1)[keep[i]:]
        labels[0, drop] = -100
        rows.append(PackedBatch(ids, labels, torch.arange(SHORT)[None], None))
    return rows


def _full_steps(rank, world, steps, strategy, settings):
    """Run ``steps`` optimizer steps (each: a list of global rows) on dp 2 × cp 2 with
    grad_accum 2; return each step's logged (loss, grad_norm, lr), the gradients the optimizer
    was given and the weights after."""
    from accelerate import Accelerator

    from lctrain.model.structure import decoder_layers
    from lctrain.parallel import build_mesh, distribute
    from lctrain.parallel.context import ContextParallel
    from lctrain.train.loop import Trainer
    from lctrain.train.optim import build_optimizer

    pmesh = build_mesh(cp=2, device_type="cpu")
    cp = ContextParallel(pmesh, "distflash", "reference", device=torch.device("cpu"))
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
    full = lambda t: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()  # noqa: E731
    seen, step = [], optimizer.step

    def recording_step(*args, **kwargs):
        seen.append({n.replace("._checkpoint_wrapped_module", ""): full(p.grad).numpy()
                     for n, p in module.named_parameters()})
        return step(*args, **kwargs)

    optimizer.step = recording_step
    logged = []
    for rows in steps:  # dp rank r takes the global rows r, r + dp, ... (as iter_batches)
        stats = trainer.train_step(rows[pmesh.dp_rank::pmesh.dp])
        loss, norm, _, _, _ = trainer.reduce_for_log(stats, 0)
        logged.append((loss, norm, stats["lr"]))
    weights = {n.replace("._checkpoint_wrapped_module", ""): full(p).numpy()
               for n, p in module.named_parameters()}
    return logged, seen, weights


def _reference_steps(steps, settings):
    """The same steps in float64 on one process with plain transformers (eager attention):
    summed token losses over the global batch ÷ its label count, torch's clipping and AdamW
    with weight decay on matrices only, at the documented warm-up / cosine rate."""
    import math

    from transformers import AutoModelForCausalLM

    model = load_model(None, config=TINY, seed=0, attn_implementation="eager").double()
    params = list(model.named_parameters())
    groups = [{"params": [p for _, p in params if p.ndim >= 2],
               "weight_decay": settings["weight_decay"]},
              {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=settings["lr"], betas=(0.9, 0.95), eps=settings["eps"],
                                  foreach=False)
    warmup, total, floor = settings["warmup"], settings["total"], settings["min_lr_ratio"]
    logged, seen = [], []
    for i, rows in enumerate(steps):
        ratio = ((i + 1) / warmup if i < warmup else
                 floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (i - warmup) / (total - warmup))))
        for group in optimizer.param_groups:
            group["lr"] = settings["lr"] * ratio
        ids = torch.cat([r.input_ids for r in rows])
        labels = torch.cat([r.labels for r in rows])
        logits = model(input_ids=ids, position_ids=torch.cat([r.position_ids for r in rows])).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                 ignore_index=-100, reduction="sum")
        loss = loss / (labels != -100).sum()
        optimizer.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings["max_grad_norm"])
        seen.append({n: p.grad.numpy().copy() for n, p in params})
        logged.append((float(loss), float(norm), settings["lr"] * ratio))
        optimizer.step()
    return logged, seen, {n: p.detach().numpy() for n, p in params}


def test_full_steps_with_dp_cp_and_grad_accum_match_one_float64_process():
    """Two optimizer steps on dp 2 × cp 2 with grad_accum 2, micro-batches holding very different
    numbers of labelled tokens (one none): the logged loss, gradient norm and rate, the clipped
    gradients AdamW gets and the weights after are those of one float64 process training on the
    whole global batch (mean over its label tokens, torch's clipping, decay on matrices only)."""
    settings = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-3, "warmup": 1, "total": 3,
                "min_lr_ratio": 0.2, "max_grad_norm": 0.5}
    steps = [_uneven_rows(4), _uneven_rows(4)[::-1]]
    want_logged, want_grads, want_weights = _reference_steps(steps, settings)
    assert want_logged[0][1] > settings["max_grad_norm"]  # clipping is at work
    for strategy in ("replicate", "fsdp"):
        per_rank = run_on_ranks(_full_steps, 4, steps, strategy, settings)
        for logged, grads, weights in per_rank:
            for (loss, norm, lr), (want_loss, want_norm, want_lr) in zip(logged, want_logged):
                assert loss == pytest.approx(want_loss, rel=1e-5), strategy
                assert norm == pytest.approx(want_norm, rel=1e-4), strategy
                assert lr == pytest.approx(want_lr, rel=1e-12), strategy
            for got, want in zip(grads, want_grads):
                for name, g in want.items():
                    np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-6,
                                               err_msg=f"{strategy}: {name}")
            for name, w in want_weights.items():
                np.testing.assert_allclose(weights[name], w, rtol=1e-5, atol=1e-5,
                                           err_msg=f"{strategy}: {name}")
