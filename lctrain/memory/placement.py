"""``train.checkpointing: auto``'s placement: the most remat layers, the GPU first, then pinned
host memory for the lowest layers."""
from __future__ import annotations

from itertools import groupby
from operator import itemgetter

from lctrain.memory.activations import input_kept, remat_kept
from lctrain.memory.arch import Architecture

Runs = tuple[tuple[str, int], ...]


def place(arch: Architecture, tokens: int, c: int, gpu_room: int, host_room: int,
          grads: int = 0) -> tuple[Runs, int] | None:
    """``auto``'s (runs, parked lowest layers) in ``gpu_room`` and ``host_room`` bytes, or None:
    the most remat layers, then the fewest bytes parked. ``grads``: gradient bytes made above
    the lowest layer by the time its backward runs (they share the room with its tensors)."""
    big, small = remat_kept(arch, tokens, c), input_kept(arch, tokens, c)
    layers = arch.num_layers
    for remat in range(layers, -1, -1):
        full = layers - remat
        if gpu_bytes(remat, 0, full, 0, big, small, grads) <= gpu_room:
            return _runs(remat, 0, full, 0)
        best = None  # (bytes parked, remat layers on the GPU, full layers on the GPU)
        for on_gpu in range(min(remat, max(gpu_room, 0) // big), -1, -1):
            full_gpu = _full_on_gpu(on_gpu, remat, full, big, small, gpu_room, grads)
            parked = (remat - on_gpu) * big + (full - full_gpu) * small
            if full_gpu >= 0 and parked <= host_room and (best is None or parked < best[0]):
                best = (parked, on_gpu, full_gpu)  # the fewest bytes over PCIe; ties: GPU
        if best is not None:
            _, on_gpu, full_gpu = best
            return _runs(on_gpu, remat - on_gpu, full_gpu, full - full_gpu)
    return None


def _full_on_gpu(on_gpu: int, remat: int, full: int, big: int, small: int, gpu_room: int,
                 grads: int) -> int:
    """Most full layers on the GPU beside ``on_gpu`` remat ones, the rest parked (-1: none)."""
    for full_gpu in range(min(full, max(gpu_room, 0) // small), -1, -1):
        if gpu_bytes(on_gpu, remat - on_gpu, full_gpu, full - full_gpu, big, small,
                     grads) <= gpu_room:
            return full_gpu
    return -1


def gpu_bytes(remat: int, remat_parked: int, full: int, full_parked: int, big: int,
              small: int, grads: int = 0) -> int:
    """The most bytes on the GPU during the backward, as `kept_during_layers` walks it, with
    the gradients made above each layer (``grads`` above the lowest, an equal share per layer).
    In the order parked full, parked remat, full, remat, the walk is constant within a parked
    run after its first layer and linear within a GPU run, so the most is at a run's first two
    layers or its last; the gradients only fall on the way up."""
    n, parked = remat + remat_parked + full + full_parked, remat_parked + full_parked

    def made(j: int) -> int:
        return grads * (n - 1 - j) // (n - 1) if n > 1 else 0

    moments = [0]
    if parked:  # a parked layer's tensors and the one below it, fetched
        first = small if full_parked else big
        moments.append(first + made(0))
        if parked > 1:
            moments.append(first + (small if full_parked > 1 else big) + made(1))
        if 0 < full_parked < parked:  # the first parked remat layer, over a full one
            moments.append(small + big + made(full_parked))
            if remat_parked > 1:
                moments.append(2 * big + made(full_parked + 1))
    below = (big if remat_parked else small) if parked else 0  # the top parked layer's
    if full:
        moments += [below + small + made(parked), below + full * small + made(parked + full - 1)]
    if remat:
        moments += [below + full * small + big + made(parked + full),
                    below + full * small + remat * big]
    return max(moments)


def _runs(remat: int, remat_parked: int, full: int, full_parked: int) -> tuple[Runs, int]:
    """Runs in forward order (parked full, parked remat, full, remat) and the parked count."""
    counts = [(name, n) for name, n in (("full", full_parked), ("remat", remat_parked),
                                        ("full", full), ("remat", remat)) if n]
    runs = tuple((name, sum(n for _, n in same)) for name, same in groupby(counts, itemgetter(0)))
    return runs, full_parked + remat_parked
