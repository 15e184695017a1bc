"""Host memory of one machine: does the pinned memory of a GPU run fit before training starts,
and does a CPU run's model fit at all?

Under ``train.checkpointing: remat-offload`` (or ``auto`` with offloaded layers) every GPU
process parks the memory model's ``host_offload`` bytes (offloaded layers' inputs and attention
outputs, and training state under ``train.state_offload``) in page-locked host memory.
Running out of it does not raise: the kernel's OOM killer ends the processes mid-step, with no
message. So the launcher checks the machine's share first, with the rule that
``lctrain estimate-memory --host-memory`` applies (`lctrain.memory.host_offload_fits`).
Only GPU runs pin memory; the caller decides whether a run is one.
"""
from __future__ import annotations

import dataclasses

from lctrain.config import RecipeConfig
from lctrain.errors import UserError
from lctrain.memory.estimate import host_offload_fits
from lctrain.memory.recipe import estimate_recipe

_GIB = 1 << 30


def check_host_memory(cfg: RecipeConfig, *, local_processes: int, gpus: int,
                      available: int | None = None) -> None:
    """Fail before training if the run would pin more host memory than this machine has.

    Args:
        cfg: the recipe (nothing is checked unless it pins host memory; ``auto`` without
            ``train.layer_policies`` places layers within this machine's memory by itself).
        local_processes: GPU training processes on this machine.
        gpus: GPUs in the whole job.
        available: host bytes available (default: ``train.host_memory``, else MemAvailable
            of /proc/meminfo; no check where that cannot be read).

    Raises:
        UserError: the parked activations of this machine's processes exceed the share of the
            available host memory that may be pinned (`lctrain.memory.HOST_USABLE`).
    """
    t = cfg.train
    explicit = t.checkpointing == "remat-offload" or (
        t.checkpointing == "auto" and t.layer_policies is not None)
    if not (explicit or t.state_offload != "none"):
        return
    if t.checkpointing == "auto" and t.layer_policies is None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, checkpointing="full"))
    if available is None:
        available = cfg.train.host_memory or available_host_bytes()
    if not available:
        return
    try:
        est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=gpus, gpu_memory=1 << 40)
    except UserError:
        return  # no readable architecture here: loading the model reports it
    parked = est.details["host_offload"]
    if not host_offload_fits(parked, local_processes, available):
        what = {"none": "", "optimizer": " and optimizer states",
                "all": ", parameters, gradients and optimizer states"}[t.state_offload]
        raise UserError(
            f"train.checkpointing {t.checkpointing} at data.seq_len {cfg.data.seq_len} parks "
            f"about {parked / _GIB:.0f} GiB of activations{what} per GPU in pinned host memory, "
            f"{parked * local_processes / _GIB:.0f} GiB for the {local_processes} processes on "
            f"this machine, but only {available / _GIB:.0f} GiB is available; lower "
            f"data.seq_len, raise parallel.cp over more machines, or keep more on the GPU "
            f"(train.checkpointing=remat or auto) (or, where the machine has more than it "
            f"reports, say how much with train.host_memory).")


def check_cpu_memory(cfg: RecipeConfig, *, processes: int, available: int | None = None) -> None:
    """Fail before loading when a CPU run cannot fit in this machine's memory.

    Each CPU process holds the model's weights, their gradients and AdamW's two states in
    ``model.dtype`` — four copies of the trainable weights, one of the frozen ones (FSDP2
    divides them over the processes) — and the activations of its share of a sequence, which
    the memory model (`lctrain.memory.estimate`) gives for ``data.seq_len``.

    Args:
        cfg: the recipe.
        processes: CPU processes of the run on this machine.
        available: host bytes available (default: ``train.host_memory``, else MemAvailable;
            no check where unknown).

    Raises:
        UserError: the run needs more than the available memory.
    """
    from lctrain.memory.lora import lora_shape, trainable_parameters
    from lctrain.memory.recipe import recipe_architecture

    if available is None:
        available = cfg.train.host_memory or available_host_bytes()
    if not available:
        return
    try:
        arch = recipe_architecture(cfg)
        est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=processes, gpu_memory=1 << 60)
    except UserError:
        return  # no readable architecture here: loading the model reports it
    params = arch.parameters()
    lora = lora_shape(cfg.lora)
    trainable = params if lora is None else trainable_parameters(arch, lora)
    state = (params + 3 * trainable) * (2 if cfg.model.dtype == "bfloat16" else 4)
    if cfg.parallel.fsdp == "on":
        state //= processes
    per_process = state + est.per_gpu_bytes["activations"]  # "other" is a GPU's workspaces
    if per_process * processes > available:
        raise UserError(
            f"at data.seq_len {cfg.data.seq_len} this CPU run needs about "
            f"{per_process / _GIB:.1f} GiB per process for the {params:,}-parameter "
            f"model's weights, gradients, AdamW states and activations, "
            f"{per_process * processes / _GIB:.1f} GiB for its {processes} process"
            f"{'es' * (processes != 1)}, but this "
            f"machine has {available / _GIB:.1f} GiB available; lower data.seq_len, choose a "
            "smaller model, or train on GPUs.")


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
