"""Parameter and gradient distribution over all dp × cp ranks.

Two strategies with ONE gradient convention: after the backward, every parameter's gradient is
the SUM over all ranks of the local gradients. The loop divides each rank's summed token loss by
the GLOBAL number of label tokens before the backward, so that sum is exactly the gradient of
the mean token loss — no extra division by the world size is wanted anywhere.

- ``fsdp`` (GPUs): FSDP2 ``fully_shard`` on each decoder layer (resharded after its forward),
  then on the root module; bf16 compute copies of fp32 sharded parameters, fp32 gradient
  reduce-scatter. FSDP2 would AVERAGE gradients over its mesh by default; on NCCL the divide
  factor is set to 1 so that it sums (a pre-multiplied sum). gloo has no pre-multiplied sum, so
  on CPU (used to test this path) FSDP2 keeps averaging and the gradients are multiplied by the
  world size afterwards — exact for a power-of-two world, within one rounding otherwise.
- ``replicate`` (CPU, or FSDP off): every rank keeps the full model; after the backward the
  gradients are summed with one all-reduce per dtype over all ranks.

``offload=True`` (``train.state_offload: all``) gives FSDP2 its CPU offload policy: the sharded
parameters, their gradients and so the optimizer's states live in pinned host memory, each unit
is copied in when it is gathered, gradients go back after the reduce-scatter, and the optimizer
steps on the CPU. It applies on one rank too (FSDP2 over a mesh of one), where nothing is
sharded but everything but the gathered units leaves the GPU.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class Distributed:
    """How the trainable module is spread over the ranks (see the module docstring).

    Attributes:
        module: the module to call (FSDP2-wrapped in place when ``strategy == "fsdp"``).
        strategy: "fsdp" or "replicate".
        group: the all-ranks process group (None in a 1-process run without one).
    """

    def __init__(self, module: nn.Module, strategy: str, group: dist.ProcessGroup | None, *,
                 post_scale: float = 1.0, norm_device: torch.device | None = None) -> None:
        self.module = module
        self.strategy = strategy
        self.group = group
        self.post_scale = post_scale
        self.norm_device = norm_device  # where the gradient norm goes (offloaded gradients)

    def sync_gradients(self) -> None:
        """Make every gradient the sum over ranks (FSDP2 already reduced it in the backward)."""
        if self.strategy == "replicate" and self.group is not None and self.group.size() > 1:
            allreduce_gradients(self.module.parameters(), self.group)
        elif self.post_scale != 1.0:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.post_scale)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Clip all gradients to a global L2 norm of ``max_norm`` (None or ≤ 0: no clipping).

        Returns:
            The global gradient norm before clipping, a 0-d float32 tensor on the device (no
            host synchronisation).
        """
        params = [p for p in self.module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if hasattr(total, "full_tensor"):  # DTensor under FSDP2: reduce the shard norms
            total = total.full_tensor()
        if max_norm is not None and max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        total = total.float()
        return total if self.norm_device is None else total.to(self.norm_device, non_blocking=True)


def allreduce_gradients(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Sum the gradients of ``params`` over ``group``, one all-reduce per gradient dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def distribute(module: nn.Module, layers: Iterable[nn.Module], *, world_mesh: DeviceMesh | None,
               strategy: str, param_dtype: torch.dtype | None = torch.bfloat16,
               reshard_after_forward: bool = True, offload: bool = False) -> Distributed:
    """Apply FSDP2 or replication to ``module`` (in place).

    Args:
        module: the root module the loop calls (its own parameters — embeddings, final norm,
            output head — form the root FSDP2 unit).
        layers: the decoder layers, each its own FSDP2 unit.
        world_mesh: 1-D DeviceMesh over all ranks (None: a 1-process run without a group).
        strategy: "fsdp" (FSDP2; needs a mesh) or "replicate".
        param_dtype: FSDP2 compute dtype of unsharded parameters (None: keep the stored dtype).
        reshard_after_forward: free each layer's unsharded parameters after its forward
            (re-gathered for the backward).
        offload: keep the sharded parameters, gradients (and so the optimizer states) in
            pinned host memory (FSDP2's ``CPUOffloadPolicy``; "fsdp" only).

    Returns:
        A `Distributed` handle.

    Raises:
        ValueError: unknown strategy, or "fsdp" without a mesh.
    """
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
    units = []
    for layer in layers:
        units.append(fully_shard(layer, mesh=world_mesh, mp_policy=policy, offload_policy=where,
                                 reshard_after_forward=reshard_after_forward))
    units.append(fully_shard(module, mesh=world_mesh, mp_policy=policy, offload_policy=where,
                             reshard_after_forward=False))
    world = world_mesh.size()
    norm_device = torch.device("cuda", torch.cuda.current_device()) if offload and cuda else None
    if world == 1:
        return Distributed(module, strategy, group, norm_device=norm_device)
    if not cuda:
        return Distributed(module, strategy, group, post_scale=float(world))
    for unit in units:
        _sum_gradients(unit)
    return Distributed(module, strategy, group, norm_device=norm_device)


def _sum_gradients(unit) -> None:
    """Make an FSDP2 unit sum gradients over its mesh instead of averaging them (NCCL)."""
    if hasattr(unit, "set_gradient_divide_factor"):
        unit.set_gradient_divide_factor(1.0)
    else:  # torch releases before set_gradient_divide_factor
        unit.set_reduce_scatter_divide_factor(1.0)
