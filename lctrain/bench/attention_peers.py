"""Other people's distributed attention, set up to be timed next to lctrain's.

Each peer is a context manager ``peer(group, shape) -> (fwd, bwd)`` run on every rank of the
group: ``fwd()`` computes this rank's attention output of a causal sequence of ``shape.seq_len``
total tokens (random bf16 inputs, ``shape.heads`` × ``shape.head_dim``) and returns what ``bwd``
needs; ``bwd(state)`` runs the backward. Both are timed by the attention bench exactly as
lctrain's own schedules are. A peer that cannot run here raises :class:`PeerUnavailable` with
one sentence saying why (the bench reports it as the row's status).

* ``context_parallel`` — torch's ``torch.distributed.tensor.experimental.context_parallel``
  (ring with head-tail load balancing, rotation by all-gather by default) on the cuDNN SDPA
  backend. CUDA only: torch has no sharding strategy for the CPU flash op.
* ``ring_flash_attn`` — the ring-flash-attention package's zigzag ring (needs flash-attn).
"""
from __future__ import annotations

import contextlib
import importlib.util
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
    """torch's context_parallel with the cuDNN SDPA backend, causal; see the module docstring.

    Raises:
        PeerUnavailable: without CUDA.
    """
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


@contextlib.contextmanager
def ring_flash_attn_peer(group, spec: Shape):
    """ring-flash-attention's zigzag ring (flash-attn kernels), causal.

    Raises:
        PeerUnavailable: if ring_flash_attn (or flash_attn) is not installed, or without CUDA.
    """
    if importlib.util.find_spec("ring_flash_attn") is None:
        raise PeerUnavailable("ring-flash-attn is not installed (pip install ring-flash-attn)")
    if spec.device.type != "cuda":
        raise PeerUnavailable("ring-flash-attn needs CUDA")
    from ring_flash_attn import zigzag_ring_flash_attn_func

    n = spec.seq_len // dist.get_world_size(group)
    q = _randn((1, n, spec.heads, spec.head_dim), spec, 1).requires_grad_()  # (1, S/P, H, D)
    k = _randn((1, n, spec.kv_heads, spec.head_dim), spec, 2).requires_grad_()
    v = _randn((1, n, spec.kv_heads, spec.head_dim), spec, 3).requires_grad_()
    do = _randn((1, n, spec.heads, spec.head_dim), spec, 4)

    def fwd():
        return zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)

    def bwd(out):
        out.backward(do)
        q.grad = k.grad = v.grad = None

    yield fwd, bwd


PEERS = {"context_parallel": context_parallel_peer, "ring_flash_attn": ring_flash_attn_peer}
