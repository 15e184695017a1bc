"""Host memory of one machine, checked before training starts: a GPU run's pinned memory (running
out of it is an OOM kill with no message) and a CPU run's whole state."""
from __future__ import annotations

from lctrain.config import RecipeConfig
from lctrain.errors import UserError
from lctrain.memory.estimate import host_offload_fits
from lctrain.memory.recipe import estimate_recipe

_GIB = 1 << 30


def check_host_memory(cfg: RecipeConfig, *, local_processes: int, gpus: int,
                      available: int | None = None) -> None:
    """Fail (UserError) before training if ``local_processes`` would pin too much host memory."""
    t, plan = cfg.train, cfg.train.layers
    if plan.state == "none" and (plan.auto or plan.parked == 0):
        return
    available = available or t.host_memory or available_host_bytes()
    if not available:
        return
    try:
        est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=gpus, gpu_memory=1 << 40,
                              checkpointing="full" if plan.auto else None)  # auto: the state
    except UserError:
        return  # no readable architecture here: loading the model reports it
    parked = est.details["host_offload"]
    if not host_offload_fits(parked, local_processes, available):
        what = {"none": "", "optimizer": " and optimizer states",
                "state": ", parameters, gradients and optimizer states"}[plan.state]
        raise UserError(
            f"train.offload {t.offload} at data.seq_len {cfg.data.seq_len} parks about "
            f"{parked / _GIB:.0f} GiB of activations{what} per GPU in pinned host memory, "
            f"{parked * local_processes / _GIB:.0f} GiB for the {local_processes} processes on "
            f"this machine, but only {available / _GIB:.0f} GiB is available; lower "
            f"data.seq_len, raise parallel.cp over more machines, or park less "
            f"(train.offload, or train.checkpointing=auto) (or, where the machine has more "
            f"than it reports, say how much with train.host_memory).")


def check_cpu_memory(cfg: RecipeConfig, *, processes: int) -> None:
    """Fail (UserError) before loading when a CPU run does not fit this machine's memory."""
    available = cfg.train.host_memory or available_host_bytes()
    if not available:
        return
    try:
        est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=processes, gpu_memory=1 << 60)
    except UserError:
        return  # no readable architecture here: loading the model reports it
    params, trainable = est.parameters_count, est.details["trainable_parameters"]
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
