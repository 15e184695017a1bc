"""Where each layer keeps what its backward needs, when ``train.checkpointing`` is ``auto``.

Per layer, the backward needs the layer input and — under remat — the attention output and lse
(`lctrain.memory.activations.remat_kept`); under full checkpointing only the input, at the price
of running the attention forward again. `place` gives every layer a policy of
`lctrain.config.tiers.LAYER_POLICIES` by one rule, cheapest first:

0. when every layer's remat tensors fit the GPU with room to spare, the room goes to layers
   that are not checkpointed at all (``none``: they keep everything their backward needs, so
   nothing of them runs again), as many as the step's peak allows (`with_unchecked`; the
   memory model counts them, `lctrain.memory.estimate`); they come last in the forward, so the
   backward frees what they keep before it recomputes the first remat layer;
1. keep the attention output of as many layers as possible (each full layer costs one more
   attention forward, the most expensive thing at long context);
2. for that many remat layers, fill the GPU first (largest kept tensors first), then pinned
   host memory (copies overlap compute, but they are not free);
3. offloaded layers come first in the forward, GPU-kept ones last: the backward starts with the
   GPU-kept layers, which gives the first host copies time to come back;
4. only when every layer is full and their inputs still do not fit the GPU and the host: the
   fewest ``full-paired`` pairs, each of which keeps one input for two layers and runs the
   lower layer's forward once more in the backward.

Placing, the GPU budgets two offloaded layers' tensors in flight (the one in use and the next
one coming back), or one without prefetching (``train.offload_prefetch: false``);
`lctrain.memory.activations.kept_during_layers` counts one where GPU-kept layers sit above
them, so a placement never asks for more than the estimate allows.
"""
from __future__ import annotations

from lctrain.config.tiers import OFFLOADED
from lctrain.memory.activations import input_kept, remat_kept
from lctrain.memory.arch import Architecture

Runs = tuple[tuple[str, int], ...]


def place(arch: Architecture, tokens: int, c: int, gpu_room: int, host_room: int,
          in_flight: int = 2) -> Runs | None:
    """The layers' policies for ``auto`` (runs in forward order), or None when nothing fits:
    the most layers that keep their attention output (remat), then, among the placements with
    that many, the fewest bytes parked in host memory (each crosses PCIe twice per step).

    Args:
        arch: the model's shapes.
        tokens: tokens per GPU (batch × seq_len / cp).
        c: bytes per element of the compute dtype.
        gpu_room: bytes of GPU memory that kept tensors may take (what the step's peak leaves).
        host_room: pinned host bytes this process may use for them.
        in_flight: offloaded layers on the GPU at a time (2 with prefetching, else 1).
    """
    big, small = remat_kept(arch, tokens, c), input_kept(arch, tokens, c)
    layers = arch.num_layers
    for remat in range(layers, -1, -1):
        full = layers - remat
        if remat * big + full * small <= gpu_room:
            return _runs(remat, 0, full, 0)
        best = None  # (bytes parked, remat layers on the GPU, full layers on the GPU)
        for on_gpu in range(min(remat, max(gpu_room, 0) // big), -1, -1):
            full_gpu = _full_on_gpu(on_gpu, remat, full, big, small, gpu_room, in_flight)
            parked = (remat - on_gpu) * big + (full - full_gpu) * small
            if full_gpu >= 0 and parked <= host_room and (best is None or parked < best[0]):
                best = (parked, on_gpu, full_gpu)  # the fewest bytes over PCIe; ties: GPU
        if best is not None:
            _, on_gpu, full_gpu = best
            return _runs(on_gpu, remat - on_gpu, full_gpu, full - full_gpu)
    return _paired(layers, small, gpu_room, host_room, in_flight)


def _paired(layers: int, small: int, gpu_room: int, host_room: int,
            in_flight: int) -> Runs | None:
    """When no layer can keep its attention output and the inputs do not fit either: the
    fewest ``full-paired`` pairs (each keeps one input on the GPU for two layers and rebuilds
    the other) that make the rest fit as full layers, the GPU first."""
    for pairs in range(1, layers // 2 + 1):
        rest, room = layers - 2 * pairs, gpu_room - pairs * small
        if room < 0:
            return None
        full_gpu = _full_on_gpu(0, 0, rest, small, small, room, in_flight)
        if full_gpu >= 0 and (rest - full_gpu) * small <= host_room:
            return _runs(0, 0, full_gpu, rest - full_gpu) + (("full-paired", 2 * pairs),)
    return None


def _full_on_gpu(on_gpu: int, remat: int, full: int, big: int, small: int, gpu_room: int,
                 in_flight: int = 2) -> int:
    """Most full layers that fit on the GPU beside ``on_gpu`` remat layers and the in-flight
    copies of the offloaded ones, ``in_flight`` at a time (-1: not even none fit)."""
    room = gpu_room - on_gpu * big
    top = min(full, max(room, 0) // small)
    item = big if remat > on_gpu else small
    steady = min(full, max(room - in_flight * item, 0) // small)  # offloaded layers in flight
    for full_gpu in sorted({top, top - 1, top - 2, steady, 0}, reverse=True):
        if full_gpu < 0:
            continue
        off_remat, off_full = remat - on_gpu, full - full_gpu
        flying = min(in_flight, off_remat + off_full) * (big if off_remat else small)
        if full_gpu * small + flying <= room:
            return full_gpu
    return -1


def with_unchecked(layers: int, count: int) -> Runs:
    """Every layer remat on the GPU but the top ``count``, which are not checkpointed."""
    return tuple((name, n) for name, n in (("remat", layers - count), ("none", count)) if n)


def _runs(remat: int, remat_off: int, full: int, full_off: int) -> Runs:
    order = (("full-offload", full_off), ("remat-offload", remat_off), ("full", full),
             ("remat", remat))
    return tuple((name, n) for name, n in order if n)


def chained_layers(runs: Runs) -> int:
    """Layers whose input is rebuilt by running the layer below once more (``full-paired``)."""
    return sum(n // 2 for name, n in runs if name == "full-paired")


def unchecked_layers(runs: Runs) -> int:
    """Layers that are not checkpointed: nothing of them runs again in the backward."""
    return sum(n for name, n in runs if name == "none")


def recomputed_layers(runs: Runs) -> int:
    """Layers whose attention forward runs again in the backward."""
    return sum(n for name, n in runs if name.startswith("full"))


def remat_layers(runs: Runs) -> int:
    """Layers that keep their attention output (remat, on the GPU or in host memory)."""
    return sum(n for name, n in runs if name.startswith("remat"))


def offloaded_layers(runs: Runs) -> int:
    """Layers whose kept tensors wait in host memory."""
    return sum(n for name, n in runs if name in OFFLOADED)
