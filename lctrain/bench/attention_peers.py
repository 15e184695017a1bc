"""Other people's distributed attention, set up to be timed next to lctrain's schedules.

Each peer is a context manager ``peer(group, shape) -> (fwd, bwd)`` run on every rank: ``fwd()``
computes this rank's output of a causal sequence of ``shape.seq_len`` total tokens (random
inputs), ``bwd(state)`` its backward. A peer that cannot run here raises `PeerUnavailable` with
one sentence why (the row's status). ``context_parallel`` is torch's experimental
context_parallel (a ring with head-tail balance) on cuDNN SDPA, CUDA only.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PeerUnavailable(RuntimeError):
    """A peer implementation cannot run on this machine (not installed, needs CUDA, ...)."""


@dataclass(frozen=True)
class Shape:
    """Sizes of one attention call: batch 1, total ``seq_len`` tokens over the group."""

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def _randn(shape, spec: Shape, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=spec.device).manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=spec.dtype, device=spec.device)


@contextlib.contextmanager
def context_parallel_peer(group, spec: Shape):
    """torch's context_parallel with the cuDNN SDPA backend, causal (needs CUDA)."""
    if spec.device.type != "cuda":
        raise PeerUnavailable("torch context_parallel needs CUDA (it has no CPU sharding "
                              "strategy for SDPA)")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    world = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cuda")
    q = _randn((1, spec.heads, spec.seq_len, spec.head_dim), spec, 1)  # (1, H, S, D)
    k = _randn((1, spec.kv_heads, spec.seq_len, spec.head_dim), spec, 2)  # (1, Hkv, S, D)
    v = _randn((1, spec.kv_heads, spec.seq_len, spec.head_dim), spec, 3)
    do = _randn((1, spec.heads, spec.seq_len // world, spec.head_dim), spec, 4)  # (1, H, S/P, D)
    extra = {"enable_gqa": True} if spec.kv_heads != spec.heads else {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), context_parallel(
            mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        for t in (q, k, v):
            t.requires_grad_(True)

        def fwd():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)

        def bwd(out):
            out.backward(do)
            q.grad = k.grad = v.grad = None

        yield fwd, bwd


PEERS = {"context_parallel": context_parallel_peer}
