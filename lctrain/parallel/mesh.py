"""The dp × cp device mesh: who shares a sequence, who shares a batch.

Ranks are row-major over (dp, cp) (global rank = dp_rank · cp + cp_rank), so the cp ranks that
exchange keys and values at every attention layer are neighbours. ``cp_group`` holds the shards of
ONE sequence; ``dp_rank`` is the data loader's replica index; ``world`` holds all ranks, over which
FSDP2 shards parameters and the label tokens are counted."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import resource
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lctrain.errors import UserError
from lctrain_kernels.distributed import nccl_options


@dataclass(frozen=True)
class ParallelMesh:
    """The process layout of one run as this rank sees it: sizes dp · cp = world size, this
    rank's coordinates, the 2-D ("dp", "cp") ``mesh`` and the 1-D ``world_mesh`` (FSDP2's),
    both None in a 1-process run without a process group."""

    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    mesh: DeviceMesh | None
    world_mesh: DeviceMesh | None
    device_type: str

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def rank(self) -> int:
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """Process group of this rank's sequence shards; None when cp == 1 (local attention)."""
        return self.mesh.get_group("cp") if self.mesh is not None and self.cp > 1 else None

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Group of all ranks, or None in a 1-process run without a process group."""
        return self.world_mesh.get_group() if self.world_mesh is not None else None

    def barrier(self) -> None:
        """Wait until every rank gets here (returns at once in a one-rank run)."""
        if self.world_group is not None and self.world_size > 1:
            dist.barrier(group=self.world_group)


def check_parallel_sizes(world_size: int, cp: int) -> tuple[int, int]:
    """(dp, cp) for ``world_size`` processes: dp = world_size / cp (UserError if it is not)."""
    if cp < 1:
        raise UserError(f"parallel.cp must be at least 1, got {cp}.")
    if world_size % cp:
        raise UserError(f"the world size {world_size} is not divisible by parallel.cp = {cp}; "
                        f"run on a multiple of {cp} processes or choose a cp that divides "
                        f"{world_size}.")
    return world_size // cp, cp


def build_mesh(cp: int, *, device_type: str = "cpu",
               timeout: timedelta | None = None) -> ParallelMesh:
    """Build the dp × cp mesh over the default process group (dp = world size / cp), on
    "cuda" (NCCL) or "cpu" (gloo); ``timeout``: the default group's, for the dp and cp groups
    (None: torch's default, whatever the default group's is). Without a process group (a plain
    1-process run) the meshes and groups are None."""
    if not dist.is_initialized():
        dp, cp = check_parallel_sizes(1, cp)
        return ParallelMesh(dp=dp, cp=cp, dp_rank=0, cp_rank=0, mesh=None, world_mesh=None,
                            device_type=device_type)
    dp, cp = check_parallel_sizes(dist.get_world_size(), cp)
    mesh = init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"),
                            backend_override=_group_options(device_type, dp, cp, timeout) or None)
    world_mesh = DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("world",))
    if cp > 1:
        # NCCL makes a communicator lazily at a group's first operation; the attention's first
        # batched send/receive may leave a rank out (document pruning), so every rank of the cp
        # group joins one collective here first.
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" \
            else torch.device(device_type)
        dist.all_reduce(torch.zeros(1, device=device), group=mesh.get_group("cp"))
    return ParallelMesh(dp=dp, cp=cp, dp_rank=mesh.get_local_rank("dp"),
                        cp_rank=mesh.get_local_rank("cp"), mesh=mesh, world_mesh=world_mesh,
                        device_type=device_type)


def _group_options(device_type: str, dp: int, cp: int, timeout: timedelta | None) -> dict:
    """DeviceMesh backend overrides: the cp group carries the attention's transfers on
    high-priority NCCL streams (lctrain_kernels.distributed.nccl_options); with a timeout,
    every group that is not the default one (a dimension spanning all ranks reuses it) gets it."""
    cuda = device_type == "cuda"
    options = {}
    if cuda and cp > 1:
        options["cp"] = ("nccl", nccl_options(timeout))
    if timeout is None:
        return options
    for name, size in (("dp", dp), ("cp", cp)):
        if name in options or size == dp * cp:
            continue
        group = dist.ProcessGroupNCCL.Options() if cuda else dist.ProcessGroupGloo._Options()
        group._timeout = timeout
        options[name] = ("nccl" if cuda else "gloo", group)
    return options


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: CUDA allocator peak on a GPU, peak resident set on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def allocator_figures(device: torch.device) -> tuple[int, int]:
    """CUDA's caching allocator so far: (the most bytes it reserved, which is what fills the GPU
    beside the context; how often it freed its cache and retried an allocation that failed, each
    a synchronising stall at the GPU's capacity); (0, 0) off a GPU."""
    if device.type != "cuda":
        return 0, 0
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("reserved_bytes.all.peak", 0)), int(stats.get("num_alloc_retries", 0))
