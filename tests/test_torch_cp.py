"""The context_parallel peer schedule: torch's ring attention inside lctrain's training loop.

Its attention only runs on CUDA (torch has no CPU sharding rule for SDPA); the GPU test
``tests/test_gpu_runs.py`` compares its losses with distflash's. Here, over gloo: torch's
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


def test_ring_attention_outside_a_session_is_an_error():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="outside torch's context"):
        torch_cp.ring_attention(q, q, q, None)


def test_context_parallel_needs_cuda_and_no_document_mask():
    with pytest.raises(UserError, match="needs CUDA GPUs"):
        torch_cp.check_available("cpu")
    torch_cp.check_available("cuda")
    with pytest.raises(ConfigError, match="data.document_mask=false"):
        load_recipe(None, ["parallel.schedule=context_parallel"])
    cfg = load_recipe(None, ["parallel.schedule=context_parallel",
                                         "data.document_mask=false", "parallel.cp=2"])
    assert cfg.parallel.layout == "zigzag" and cfg.parallel.seq_chunks == 4
