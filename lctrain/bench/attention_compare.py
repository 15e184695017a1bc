"""What the attention bench compares lctrain's schedules with: other people's distributed
attention, timed beside them, and the single-device result, the correctness gate.

A peer is a context manager ``peer(group, seq_len, cfg, dtype, device) -> (fwd, bwd)`` run on
every rank on a random causal sequence of ``seq_len`` tokens with ``cfg``'s heads, kv_heads and
head_dim; one that cannot run here raises `PeerUnavailable` (the row's status).
``context_parallel`` is torch's experimental ring on cuDNN SDPA, CUDA only.
The gate: a schedule is correct when its largest relative error of out, dq, dk, dv against the
float32 reference of the whole sequence is at most twice the single-device kernel's (or 1e-4).
With documents, everything runs the check's mix."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from lctrain.bench.kernel import relative_error
from lctrain_kernels import attention_with_lse, dist_attention
from lctrain_kernels.distributed import make_schedule, shard
from lctrain_kernels.vocabulary import SCHEDULES

_FLOOR = 1e-4


class PeerUnavailable(RuntimeError):
    """A peer implementation cannot run on this machine (not installed, needs CUDA, ...)."""


@contextlib.contextmanager
def context_parallel_peer(group, seq_len: int, cfg, dtype: torch.dtype, device: torch.device):
    """torch's context_parallel with the cuDNN SDPA backend, causal (needs CUDA)."""
    if device.type != "cuda":
        raise PeerUnavailable("torch context_parallel needs CUDA (it has no CPU sharding "
                              "strategy for SDPA)")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    world = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cuda")
    gen = torch.Generator(device=device)
    sizes = [(cfg.heads, seq_len), (cfg.kv_heads, seq_len), (cfg.kv_heads, seq_len),
             (cfg.heads, seq_len // world)]  # q, k, v: (1, H or Hkv, S, D); do: (1, H, S/P, D)
    q, k, v, do = (torch.randn((1, h, n, cfg.head_dim), generator=gen.manual_seed(seed),
                               dtype=dtype, device=device) for seed, (h, n) in enumerate(sizes, 1))
    extra = {"enable_gqa": True} if cfg.kv_heads != cfg.heads else {}
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


def _grads(fn, inputs, do):
    """(out, dq, dk, dv) of ``fn`` on leaf copies of ``inputs``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(do)
    return [out.detach()] + [t.grad for t in leaves]


def check_schedules(group, device: torch.device, dtype: torch.dtype, cfg, variants) -> dict[str, dict]:
    """``{row name: {"max_rel_err", "single_rel_err", "correct"}}`` of each lctrain variant
    ``(row name, schedule or peer, overlap)`` (peers are not checked), the same on every rank;
    ``cfg`` gives check_len, check_documents, heads, kv_heads, head_dim and backend."""
    gen = torch.Generator().manual_seed(1234)
    s, d = cfg.check_len, cfg.head_dim
    q, k, v, do = (torch.randn((1, s, h, d), generator=gen).to(device)  # float32, (1, S, H, D)
                   for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads, cfg.heads))
    cu = None if cfg.check_documents is None else list(cfg.check_documents.cu_seqlens)
    ref = _grads(lambda *x: attention_with_lse(*x, cu_seqlens=cu, backend="reference")[0], (q, k, v), do)
    low = [t.to(dtype) for t in (q, k, v, do)]
    single = _grads(lambda *x: attention_with_lse(*x, cu_seqlens=cu, backend=cfg.backend)[0],
                    low[:3], low[3])
    single_err = max(map(relative_error, single, ref))
    results = {}
    world = dist.get_world_size(group)
    for name, what, overlap in variants:
        if what not in SCHEDULES:
            continue
        layout = make_schedule(world, what).layout
        loc = [shard(t, group, layout) for t in low]
        got = _grads(lambda *x: dist_attention(*x, group=group, cu_seqlens=cu, schedule=what,
                                               backend=cfg.backend, overlap=overlap), loc[:3], loc[3])
        err = torch.tensor(max(relative_error(a, shard(b, group, layout)) for a, b in zip(got, ref)),
                           device=device)
        dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
        err = float(err)
        results[name] = {"max_rel_err": err, "single_rel_err": single_err,
                         "correct": err <= max(2 * single_err, _FLOOR)}
    return results
