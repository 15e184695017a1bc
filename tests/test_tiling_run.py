"""Whole training runs on two gloo ranks with the long-context settings: tiles, head groups,
per-layer checkpointing with host-parked layers, AdamW states on the host (HostAdamW) and
FSDP2's CPU offload — the same per-step losses as the plain run, an exact resume with host
states, and a banner that names the settings in the recipe's words."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lctrain.config import load_recipe
from lctrain.parallel.host_optim import HostAdamW
from spawn import run_on_ranks


def _cfg(out: Path, **sets):
    base = {"data.seq_len": 128, "data.max_documents": 24, "train.max_steps": 3,
            "train.warmup_steps": 1, "train.loss_chunk_tokens": 48, "train.lr": 3e-3,
            "parallel.attention_backend": "reference", "parallel.cp": 2,
            "parallel.fsdp": "off", "checkpoint.export_final": False}
    base.update(sets)
    return load_recipe(None, [f"{k}={v}" for k, v in base.items()], output_dir=str(out))


def _metrics(cfg) -> list[dict]:
    path = Path(cfg.train.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_all(rank, world, cfgs, resume):
    from lctrain.train.runner import run_worker

    records = []
    for cfg, again in zip(cfgs, resume):
        assert run_worker(cfg, resume=again) == 0
        records.append(_metrics(cfg) if rank == 0 else None)
    return records


def test_long_context_settings_train_like_the_plain_run(tmp_path, capfd):
    tiers = {"train.checkpointing": "full=1,remat=1", "train.offload": "layers=1,optimizer",
             "train.tile_tokens": 24, "parallel.head_groups": 2}
    plain = _cfg(tmp_path / "plain")
    host_adam = _cfg(tmp_path / "host", **tiers)
    short = _cfg(tmp_path / "resumed", **tiers, **{"train.max_steps": 2})
    resumed = _cfg(tmp_path / "resumed", **tiers)
    offload_all = _cfg(tmp_path / "all", **{"train.checkpointing": "auto",
                                            "train.offload": "state", "train.tile_tokens": 40,
                                            "parallel.fsdp": "auto"})
    cfgs = [plain, host_adam, short, resumed, offload_all]
    records = run_on_ranks(_run_all, 2, cfgs, [False, False, False, True, False])[0]
    got = [[r["loss"] for r in run] for run in records]
    norms = [[r["grad_norm"] for r in run] for run in records]  # before clipping
    want = got[0]
    assert len(want) == 3 and want[-1] < want[0]
    for i, name in ((1, "host"), (3, "resumed"), (4, "all")):
        assert got[i] == pytest.approx(want, rel=1e-4), name
        # AdamW's steps hardly change with the gradients' scale: the norms must agree too
        assert norms[i] == pytest.approx(norms[0], rel=1e-4), name
    assert len(got[2]) == 2 and got[3][:2] == got[2]  # the resume appended step 3
    out = capfd.readouterr().out
    assert ("memory: checkpointing full=1,remat=1, offload layers=1,optimizer, tile_tokens 24, "
            "head_groups 2") in out
    assert ("memory: checkpointing none (placed by the memory model), offload state, "
            "tile_tokens 40") in out  # room for every layer whole: none recomputed


def test_host_adamw_is_adamw():
    """Several steps of HostAdamW (states streamed in small chunks) against torch's AdamW; a
    step flagged non-finite is skipped whole."""
    torch.manual_seed(int(torch.randint(0, 1 << 30, ())))
    shapes = [(7, 5), (5,), (3, 11), (13,)]
    ref = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    adam, host = torch.optim.AdamW(ref, **kw), HostAdamW(ours, chunk_bytes=200, **kw)
    for _ in range(4):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, q, g in zip(ref, ours, grads):
            p.grad, q.grad = g.clone(), g.clone()
        adam.step()
        host.step()
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14)
    # a step the loop flags as non-finite (found_inf, as for fused AdamW) changes nothing
    kept = [(q.detach().clone(), host.state[q]["exp_avg"].clone(),
             host.state[q]["exp_avg_sq"].clone(), host.state[q]["step"].clone()) for q in ours]
    for q in ours:
        q.grad = torch.full_like(q, float("nan"))
    host.found_inf = torch.ones(())
    host.step()
    del host.found_inf
    for q, (weight, avg, avg_sq, step) in zip(ours, kept):
        state_now = host.state[q]
        assert torch.equal(q, weight) and torch.equal(state_now["exp_avg"], avg)
        assert torch.equal(state_now["exp_avg_sq"], avg_sq) and torch.equal(state_now["step"], step)
    state = host.state_dict()
    fresh = HostAdamW([p.detach().clone().requires_grad_() for p in ours], **kw)
    fresh.load_state_dict(state)
    assert all(fresh.state[p]["exp_avg"].device.type == "cpu" for p in fresh.state)


@pytest.mark.gpu
def test_host_adamw_streams_states_through_the_gpu():
    """On a GPU the states stay pinned on the host and chunks stream through: torch's AdamW's
    parameters after several steps, within float32 rounding."""
    torch.manual_seed(0)
    shapes = [(256, 300), (300,), (64, 1000), (4000,)]
    ref = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    ours = [p.detach().clone().requires_grad_() for p in ref]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    adam, host = torch.optim.AdamW(ref, **kw), HostAdamW(ours, chunk_bytes=1 << 19, **kw)
    for _ in range(5):
        for p, q in zip(ref, ours):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        adam.step()
        host.step()
    for p, q in zip(ref, ours):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    host.synchronize()
    states = [s[k] for s in host.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in states)
    torch.testing.assert_close(host.state[ours[0]]["exp_avg"],
                               adam.state[ref[0]]["exp_avg"].cpu(), rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
def test_host_adamw_keeps_the_states_of_sharded_parameters_on_the_host(tmp_path):
    """Under FSDP2 the parameters are DTensors on a GPU mesh: their states must still live in
    pinned host memory (DTensor.from_local would move them to the GPU), and the GPU must not
    hold them after a step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(1024, 1024, device="cuda"),
                                                       mesh, [Shard(0)])) for _ in range(4)]
        host = HostAdamW(params, lr=1e-3, chunk_bytes=1 << 22)
        for p in params:
            p.grad = distribute_tensor(torch.randn(1024, 1024, device="cuda"), mesh, [Shard(0)])
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        host.step()
        host.synchronize()
        torch.cuda.synchronize()
        states = [s[k] for s in host.state.values() for k in ("exp_avg", "exp_avg_sq")]
        assert all(t._local_tensor.device.type == "cpu" and t._local_tensor.is_pinned()
                   for t in states)
        assert torch.cuda.memory_allocated() - before < 4 * 1024 * 1024 * 4  # no 32 MiB of states
    finally:
        if owned:
            dist.destroy_process_group()
