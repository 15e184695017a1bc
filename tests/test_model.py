"""The "lctrain" attention inside a transformers model, and model loading.

A tiny Llama (grouped-query attention) with attn "lctrain" must give the logits and gradients of
the very same weights run with transformers' own "eager" attention; over gloo ranks with context
parallelism, each rank's shard of the logits and the rank-summed gradients must match the
single-process run, with and without packed documents.
"""
from __future__ import annotations

import pytest
import torch

from lctrain.errors import UserError
from lctrain.model import CPContext, load_model
from lctrain.model.structure import decoder_layers, output_head
from spawn import run_on_ranks

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "vocab_size": 101, "max_position_embeddings": 512, "rope_theta": 10000.0}


def _model(seed: int = 0):
    return load_model(None, config=TINY, seed=seed, dtype=torch.float32)


def _logits_and_grads(model, ids, positions, probe, **kwargs):
    """Logits and the gradients of sum(logits * probe) — a loss that touches every logit."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=positions, **kwargs).logits  # (B, S, V)
    (logits * probe).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


def _assert_close_grads(got: dict, want: dict, atol: float = 1e-5) -> None:
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=atol, msg=name)


def test_lctrain_attention_matches_eager_causal():
    model = _model()
    assert model.config._attn_implementation == "lctrain"
    ids = torch.randint(0, TINY["vocab_size"], (2, 48))
    positions = torch.arange(48).expand(2, 48)
    probe = torch.randn(2, 48, TINY["vocab_size"])
    ours = _logits_and_grads(model, ids, positions, probe)
    model.set_attn_implementation("eager")
    eager = _logits_and_grads(model, ids, positions, probe)
    torch.testing.assert_close(ours[0], eager[0], rtol=1e-4, atol=1e-5)
    _assert_close_grads(ours[1], eager[1])


def test_float32_parameters_under_bf16_autocast_match_sdpa():
    """fp32 master weights + bf16 autocast on one device: RoPE hands attention float32 q, k and a
    bf16 v; lctrain's attention computes in bf16 like SDPA under autocast (no dtype error)."""
    model = _model(seed=1)
    ids = torch.randint(0, TINY["vocab_size"], (1, 40))
    positions = torch.arange(40)[None]
    probe = torch.randn(1, 40, TINY["vocab_size"])
    runs = {}
    for attn in ("lctrain", "sdpa"):
        model.set_attn_implementation(attn)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[attn] = _logits_and_grads(model, ids, positions, probe)
    (ours, grads), (sdpa, sdpa_grads) = runs["lctrain"], runs["sdpa"]
    torch.testing.assert_close(ours.float(), sdpa.float(), rtol=3e-2, atol=3e-2)
    for name, g in sdpa_grads.items():
        assert (grads[name] - g).norm() <= 5e-2 * g.norm() + 1e-6, name


def test_documents_match_separate_sequences():
    """Packed documents with restarting positions == each document run on its own."""
    model = _model()
    lens = [20, 7, 21]
    ids = torch.randint(0, TINY["vocab_size"], (1, sum(lens)))
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 20, 27, 48], dtype=torch.int32)
    logits = model(input_ids=ids, position_ids=positions, cp_context=CPContext(cu_seqlens=cu)).logits
    model.set_attn_implementation("eager")
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = model(input_ids=ids[:, start:stop]).logits
        torch.testing.assert_close(logits[:, start:stop], alone, rtol=1e-4, atol=1e-5)


def test_structure_helpers():
    model = _model()
    assert decoder_layers(model) == list(model.model.layers)
    assert output_head(model) is model.lm_head


def test_load_errors_are_one_sentence(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(str(tmp_path / "missing"), config=None, seed=0)
    with pytest.raises(UserError, match="could not read the config of model 'nobody-xyz/not-a-model'"):
        load_model("nobody-xyz/not-a-model", config=None, seed=0)
    with pytest.raises(UserError, match="model_type"):
        load_model(None, config={"hidden_size": 8}, seed=0)


def test_local_folder_round_trip(tmp_path):
    model = _model(seed=3)
    model.save_pretrained(tmp_path / "tiny")
    again = load_model(str(tmp_path / "tiny"), config=None, seed=0)
    assert again.config._attn_implementation == "lctrain"
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def _cases(seq: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(position ids, cu_seqlens): one causal sequence, then packed documents."""
    cuts = sorted(torch.randperm(seq - 1)[:3].add(1).tolist())
    cu = torch.tensor([0, *cuts, seq], dtype=torch.int32)
    doc_pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    return [(torch.arange(seq)[None], None), (doc_pos[None], cu)]


def _cp_worker(rank, world, schedule, ids, probe, cases):
    from lctrain_kernels.distributed import make_schedule, shard

    model = _model()
    layout = make_schedule(world, schedule).layout
    pg = torch.distributed.group.WORLD
    results = []
    for positions, cu in cases:
        ctx = CPContext(group=pg, cu_seqlens=cu, schedule=schedule, backend="reference")
        sharded = [shard(t, group=pg, layout=layout, dim=1) for t in (ids, positions, probe)]
        logits, grads = _logits_and_grads(model, *sharded, cp_context=ctx)
        for g in grads.values():
            torch.distributed.all_reduce(g)
        # numpy, not tensors: a queued tensor's storage lives in this process, which exits
        results.append((logits.numpy(), {n: g.numpy() for n, g in grads.items()}))
    return results


def test_context_parallel_matches_single_process():
    """Sharded forward/backward over gloo ranks == one process, with and without documents.

    Three ranks (an odd world) with the zigzag layout; two ranks with distflash are covered
    through the training step in test_train_grads.py.
    """
    world, schedule = 3, "zigzag"
    from lctrain_kernels.distributed import make_schedule, shard

    seq = 36 * world
    ids = torch.randint(0, TINY["vocab_size"], (1, seq))
    probe = torch.randn(1, seq, TINY["vocab_size"])
    cases = _cases(seq)
    model = _model()
    want = [_logits_and_grads(model, ids, positions, probe, cp_context=CPContext(cu_seqlens=cu))
            for positions, cu in cases]
    per_rank = run_on_ranks(_cp_worker, world, schedule, ids, probe, cases)
    layout = make_schedule(world, schedule).layout
    for rank, results in enumerate(per_rank):
        for (logits, grads), (want_logits, want_grads) in zip(results, want):
            logits, grads = torch.from_numpy(logits), {n: torch.from_numpy(g) for n, g in grads.items()}
            expect = shard(want_logits, layout=layout, dim=1, rank=rank, world_size=world)
            torch.testing.assert_close(logits, expect, rtol=1e-4, atol=1e-5)
            _assert_close_grads(grads, want_grads, atol=2e-5)
