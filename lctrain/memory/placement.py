"""``train.checkpointing: auto``'s placement: the most remat layers, the GPU first, then pinned
host memory for the lowest layers."""
from __future__ import annotations

from lctrain.memory.activations import input_kept, remat_kept
from lctrain.memory.arch import Architecture

Runs = tuple[tuple[str, int], ...]


def place(arch: Architecture, tokens: int, c: int, gpu_room: int,
          host_room: int) -> tuple[Runs, int] | None:
    """``auto``'s (runs, parked lowest layers) in ``gpu_room`` and ``host_room`` bytes, or None:
    the most remat layers, then the fewest bytes parked."""
    big, small = remat_kept(arch, tokens, c), input_kept(arch, tokens, c)
    layers = arch.num_layers
    for remat in range(layers, -1, -1):
        full = layers - remat
        if remat * big + full * small <= gpu_room:
            return _runs(remat, 0, full, 0)
        best = None  # (bytes parked, remat layers on the GPU, full layers on the GPU)
        for on_gpu in range(min(remat, max(gpu_room, 0) // big), -1, -1):
            full_gpu = _full_on_gpu(on_gpu, remat, full, big, small, gpu_room)
            parked = (remat - on_gpu) * big + (full - full_gpu) * small
            if full_gpu >= 0 and parked <= host_room and (best is None or parked < best[0]):
                best = (parked, on_gpu, full_gpu)  # the fewest bytes over PCIe; ties: GPU
        if best is not None:
            _, on_gpu, full_gpu = best
            return _runs(on_gpu, remat - on_gpu, full_gpu, full - full_gpu)
    return None


def _full_on_gpu(on_gpu: int, remat: int, full: int, big: int, small: int, gpu_room: int) -> int:
    """Most full layers on the GPU beside ``on_gpu`` remat ones, the rest parked (-1: none)."""
    for full_gpu in range(min(full, max(gpu_room, 0) // small), -1, -1):
        if gpu_bytes(on_gpu, remat - on_gpu, full_gpu, full - full_gpu, big, small) <= gpu_room:
            return full_gpu
    return -1


def gpu_bytes(remat: int, remat_parked: int, full: int, full_parked: int, big: int,
              small: int) -> int:
    """The most kept bytes on the GPU during the backward, as `kept_during_layers` walks it."""
    parked = remat_parked + full_parked
    top = (big if remat_parked else small) if parked else 0
    pair = sorted([big] * min(remat_parked, 2) + [small] * min(full_parked, 2))[-2:]
    return max(remat * big + full * small + top, sum(pair) if parked > 1 else top)


def _runs(remat: int, remat_parked: int, full: int, full_parked: int) -> tuple[Runs, int]:
    """Runs in forward order (parked full, parked remat, full, remat) and the parked count."""
    runs: list[list] = []
    for name, n in (("full", full_parked), ("remat", remat_parked), ("full", full),
                    ("remat", remat)):
        if n and runs and runs[-1][0] == name:
            runs[-1][1] += n
        elif n:
            runs.append([name, n])
    return tuple((name, n) for name, n in runs), full_parked + remat_parked
