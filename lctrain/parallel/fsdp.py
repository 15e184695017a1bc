"""Parameters and gradients over all ranks; after the backward every gradient is the SUM over
ranks. ``fsdp``: FSDP2 per decoder layer and root (CPU offload for ``train.offload: state``);
``replicate``: one all-reduce per dtype."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter


@dataclass(eq=False)
class Distributed:
    """The module the ranks call, spread by ``strategy`` ("fsdp" or "replicate") over ``group``."""

    module: nn.Module
    strategy: str
    group: dist.ProcessGroup | None
    post_scale: float = 1.0
    norm_device: torch.device | None = None  # where the gradient norm goes (offloaded gradients)

    def sync_gradients(self) -> None:
        """Make every gradient the sum over ranks (FSDP2 already reduced it in the backward;
        replicated, one all-reduce per gradient dtype)."""
        if self.strategy == "replicate" and self.group is not None and self.group.size() > 1:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in self.module.parameters():
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
            for grads in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
        elif self.post_scale != 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.post_scale)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Clip to a global L2 norm (None or ≤ 0: no clipping); the norm before, on the device."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if hasattr(total, "full_tensor"):  # DTensor under FSDP2: reduce the shard norms
            total = total.full_tensor()
        if max_norm is not None and max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        total = total.float()
        return total if self.norm_device is None else total.to(self.norm_device, non_blocking=True)


class ComputePoolReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter with its buffers from the compute stream's memory pool.

    FSDP2 allocates each unit's reduce-scatter output, the sharded float32 gradient that lives
    until the optimizer step, on its reduce-scatter stream. The caching allocator never lends one
    stream's free memory to another, so the whole model's sharded gradients stay reserved on that
    stream through the next forward while the compute stream reserves its own memory for the
    activations: the sum of two peaks that never meet. Taken from the compute stream's pool, the
    gradients' memory holds activations once the optimizer step has freed it."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        using = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.stream):
            out = torch.empty(*size, dtype=dtype, device=device)
        if using != self.stream:  # reused only once the reduce-scatter stream is past it
            out.record_stream(using)
        return out


def distribute(module: nn.Module, layers: Iterable[nn.Module], *, world_mesh: DeviceMesh | None,
               strategy: str, param_dtype: torch.dtype | None = torch.bfloat16,
               offload: bool = False) -> Distributed:
    """Apply FSDP2 (``layers`` units, ``module`` root; ``offload``: CPU) or replication."""
    group = world_mesh.get_group() if world_mesh is not None else None
    if strategy == "replicate":
        if offload:
            raise ValueError("offloading parameters to the host needs the fsdp strategy")
        return Distributed(module, strategy, group)
    if strategy != "fsdp":
        raise ValueError(f"unknown parallel strategy {strategy!r}; choose fsdp or replicate")
    if world_mesh is None:
        raise ValueError("FSDP2 needs an initialised process group and device mesh")
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    cuda = world_mesh.device_type == "cuda"
    where = CPUOffloadPolicy(pin_memory=cuda) if offload else OffloadPolicy()
    units = [fully_shard(m, mesh=world_mesh, mp_policy=policy, offload_policy=where,
                         reshard_after_forward=m is not module) for m in [*layers, module]]
    world = world_mesh.size()
    for unit in units if cuda and world > 1 else ():  # sum over the mesh, not average (NCCL)
        unit.set_gradient_divide_factor(1.0)
    if cuda:  # the sharded gradients in the compute stream's memory, which the forward reuses
        pool = ComputePoolReduceScatter(torch.cuda.current_stream())
        for unit in units:
            unit.set_custom_reduce_scatter(pool)
    norm_device = torch.device("cuda", torch.cuda.current_device()) if offload and cuda else None
    return Distributed(module, strategy, group, post_scale=1.0 if cuda else float(world),
                       norm_device=norm_device)  # off CUDA: the mean scaled back to the sum
