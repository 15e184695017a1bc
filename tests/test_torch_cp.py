"""One run's context parallelism (`ContextParallel`) and its peer schedule, torch's ring.

torch's ring attention only runs on CUDA (torch has no CPU sharding rule for SDPA); the GPU test
``tests/test_gpu_runs.py`` compares its losses with distflash's. Here, over gloo: the object cuts
a sequence in each schedule's layout and names each schedule's attention function, torch's
head-tail sharding is lctrain's zigzag layout, torch's SDPA patch lives exactly as long as a
session, and every misuse is one clear error.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lctrain.config import ConfigError, load_recipe
from lctrain.errors import UserError
from lctrain.parallel import torch_cp
from spawn import run_on_ranks


def _session_worker(rank: int, world: int, seq_len: int):
    from torch.distributed.device_mesh import DeviceMesh
    import torch.distributed as dist

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    peer = torch_cp.TorchContextParallel(mesh, rank, torch.device("cpu"))
    with peer.session(seq_len):
        patched = F.scaled_dot_product_attention is not torch_cp._PLAIN_SDPA
    restored = F.scaled_dot_product_attention is torch_cp._PLAIN_SDPA
    return patched, restored, sorted(peer.checked)


@pytest.mark.parametrize("world", [2, 3])
def test_torch_head_tail_sharding_is_our_zigzag_layout(world):
    seq_len = 2 * world * int(torch.randint(2, 6, ()).item())
    for patched, restored, checked in run_on_ranks(_session_worker, world, seq_len):
        assert patched and restored and checked == [seq_len]


def _expected_positions(world: int, rank: int, seq_len: int, layout: str) -> list[int]:
    if layout == "contiguous":
        n = seq_len // world
        return list(range(rank * n, (rank + 1) * n))
    n = seq_len // (2 * world)  # zigzag: chunk r from the head, chunk 2P-1-r from the tail
    head, tail = rank * n, (2 * world - 1 - rank) * n
    return list(range(head, head + n)) + list(range(tail, tail + n))


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_cuts_each_schedules_layout(world):
    """Every cp rank's view of one run (the mesh's coordinates; shard needs no transfer)."""
    from lctrain.data import PackedBatch
    from lctrain.parallel.context import ContextParallel
    from lctrain.parallel.mesh import ParallelMesh

    seq_len = 2 * world * int(torch.randint(2, 6, ()).item())
    ids = torch.randint(0, 1000, (2, seq_len))
    batch = PackedBatch(ids, ids + 1, torch.arange(seq_len).expand(2, -1), (0, 3, seq_len))
    for rank in range(world):
        pmesh = ParallelMesh(dp=1, cp=world, dp_rank=0, cp_rank=rank, mesh=None, world_mesh=None,
                             device_type="cpu")
        for schedule, layout in (("distflash", "contiguous"), ("ring", "contiguous"),
                                 ("zigzag", "zigzag")):
            cp = ContextParallel(pmesh, schedule, "reference", device=torch.device("cpu"))
            shard = cp.shard(batch)
            want = _expected_positions(world, rank, seq_len, layout)
            assert (cp.layout, cp.attention) == (layout, "lctrain")
            assert shard.position_ids[0].tolist() == want
            assert torch.equal(shard.input_ids, ids[:, want])  # the columns stay together
            assert torch.equal(shard.labels, shard.input_ids + 1)
            ctx = cp.context(shard)
            assert (ctx.cu_seqlens, ctx.schedule, ctx.backend) == ((0, 3, seq_len), schedule,
                                                                   "reference")
            with cp.session(shard):  # nothing to enter for lctrain's own schedules
                assert F.scaled_dot_product_attention is torch_cp._PLAIN_SDPA


def test_ring_attention_outside_a_session_is_an_error():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="outside torch's context"):
        torch_cp.ring_attention(q, q, q, None)


def test_the_peer_registers_its_own_attention_function():
    from transformers import AttentionInterface, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    from lctrain.model import CPContext

    name = torch_cp.register_attention()
    assert name != "lctrain" and AttentionInterface()[name] is torch_cp.torch_cp_attention
    module = LlamaAttention(LlamaConfig(hidden_size=64, num_attention_heads=4), layer_idx=0)
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(RuntimeError, match="outside torch's context"):
        torch_cp.torch_cp_attention(module, q, q, q, None, cp_context=CPContext())
    with pytest.raises(ValueError, match="data.document_mask=false"):
        torch_cp.torch_cp_attention(module, q, q, q, None, cp_context=CPContext(cu_seqlens=(0, 8)))
    with pytest.raises(ValueError, match="attention dropout is 0.1 .*set the model.s attention dropout to 0"):
        torch_cp.torch_cp_attention(module, q, q, q, None, dropout=0.1)


def test_context_parallel_needs_cuda_and_no_document_mask():
    from lctrain.parallel.context import check_runnable

    with pytest.raises(UserError, match="needs CUDA GPUs"):
        torch_cp.check_available("cpu")
    torch_cp.check_available("cuda")
    with pytest.raises(UserError, match="needs CUDA GPUs"):
        check_runnable("context_parallel", 2, "cpu")
    check_runnable("context_parallel", 1, "cpu")  # one rank: plain local attention
    check_runnable("distflash", 2, "cpu")
    with pytest.raises(ConfigError, match="data.document_mask=false"):
        load_recipe(None, ["parallel.schedule=context_parallel"])
    cfg = load_recipe(None, ["parallel.schedule=context_parallel",
                                         "data.document_mask=false", "parallel.cp=2"])
    assert cfg.parallel.layout == "zigzag" and cfg.parallel.seq_chunks == 4
