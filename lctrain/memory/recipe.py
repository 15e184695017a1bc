"""`estimate_recipe`: the memory model applied to a recipe (what ``lctrain estimate-memory`` calls)."""
from __future__ import annotations

import dataclasses
import os

from lctrain.config.paths import is_placeholder
from lctrain.config.schema import ParallelConfig, RecipeConfig, TrainConfig
from lctrain.config.tiers import parse_layer_policies
from lctrain.errors import UserError
from lctrain.memory.arch import Architecture, from_config_dict, load_architecture
from lctrain.memory.estimate import estimate
from lctrain.memory.lora import lora_shape
from lctrain.memory.presets import PRESETS
from lctrain.memory.report import MemoryEstimate
from lctrain_kernels.vocabulary import seq_chunks


_FSDP = {"auto": True, "on": "on", "off": False}
"""parallel.fsdp -> the memory model's ``fsdp`` (auto: FSDP2 on several GPUs; on: always)."""


def estimate_recipe(cfg: RecipeConfig | None, *, model: str | None = None, seq_len: int,
                    gpus: int, gpu_memory: int, cp: int | None = None,
                    policy: str | None = None, host_memory: int | None = None,
                    gpus_per_node: int | None = None) -> MemoryEstimate:
    """Estimate the per-GPU memory of training a recipe (or a bare model with default settings).

    Args:
        cfg: the recipe (its lora section included); None uses the recipe defaults (cp 1,
            distflash, FSDP2, fp32 master weights with bf16 compute, no LoRA) around ``model``.
        model: a preset name (`lctrain.memory.presets`), a config.json or a model folder;
            overrides the recipe's model.
        seq_len: tokens per sequence.
        gpus: GPUs in the job.
        gpu_memory: bytes per GPU.
        cp: context-parallel degree (default: the recipe's).
        policy: checkpointing policy (default: the recipe's train.checkpointing); with auto,
            the recipe's train.layer_policies, else placed by the model.
        host_memory, gpus_per_node: host bytes and GPU processes per machine, to check the
            pinned memory too and let auto use it (see `lctrain.memory.estimate`).

    Returns:
        A `MemoryEstimate` with ``fits`` and ``max_seq_len`` filled in.

    Raises:
        UserError: no model to estimate, an unreadable model config, cp not dividing gpus, or a
            seq_len the layout cannot split.
    """
    arch = recipe_architecture(cfg, model)
    parallel = cfg.parallel if cfg is not None else ParallelConfig()
    train = cfg.train if cfg is not None else TrainConfig()
    cp = parallel.cp if cp is None else cp
    master = cfg.model.dtype if cfg is not None else "float32"
    compute = "bfloat16" if train.mixed_precision in ("auto", "bf16") else master
    policy = policy or train.checkpointing
    runs = (parse_layer_policies(train.layer_policies)
            if policy == "auto" and train.layer_policies is not None else None)
    return estimate(arch, seq_len, gpus, cp, policy, compute,
                    master_dtype=master, batch_size=train.batch_size,
                    grad_accum=train.grad_accum, fsdp=_FSDP[parallel.fsdp],
                    loss_chunk_tokens=train.loss_chunk_tokens, gpu_memory=gpu_memory,
                    seq_chunks=seq_chunks(cp, parallel.layout),
                    host_memory=host_memory, gpus_per_node=gpus_per_node,
                    lora=lora_shape(cfg.lora) if cfg is not None else None,
                    tile_tokens=train.tile_tokens, head_groups=parallel.head_groups,
                    layer_policies=runs, state_offload=train.state_offload,
                    offload_prefetch=train.offload_prefetch)


def layer_policies_for(cfg: RecipeConfig, *, gpus: int, gpu_memory: int,
                       host_memory: int | None, gpus_per_node: int) -> tuple[tuple[str, int], ...]:
    """The layers' policies a ``checkpointing: auto`` run uses: the recipe's
    ``train.layer_policies``, else the memory model's placement for this GPU and host memory
    (`lctrain.memory.tiers.place`).

    Raises:
        UserError: no readable architecture, or layer policies that do not cover the model.
    """
    if cfg.train.layer_policies is not None:
        return parse_layer_policies(cfg.train.layer_policies)
    est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=gpus, gpu_memory=gpu_memory,
                          policy="auto", host_memory=host_memory, gpus_per_node=gpus_per_node)
    return parse_layer_policies(est.details["layer_policies"])


def recipe_architecture(cfg: RecipeConfig | None, model: str | None = None) -> Architecture:
    """The architecture to estimate: ``model`` (preset, config.json, folder) if given, else the
    recipe's model.path (a hub name is read through transformers; model.config overrides cannot
    change its shapes) or its random-init model.config; with the recipe's model.fused_norms,
    model.fused_mlp or model.fused_loss off, its norms, MLPs or loss run unfused, with
    model.grouped_attention off its attention projections do not run in head groups, and with
    model.deferred_norms off its norms run before the modules that read them.

    Raises:
        UserError: nothing to read an architecture from (model.path still a placeholder), or an
            unreadable config.
    """
    arch = _model_architecture(cfg, model)
    if cfg is not None:
        arch = dataclasses.replace(arch, fused_norms=arch.fused_norms and cfg.model.fused_norms,
                                   fused_mlp=arch.fused_mlp and cfg.model.fused_mlp,
                                   fused_loss=arch.fused_loss and cfg.model.fused_loss,
                                   grouped_attention=(arch.grouped_attention
                                                      and cfg.model.grouped_attention),
                                   norm_in_tiles=arch.norm_in_tiles and cfg.model.deferred_norms,
                                   norm_in_attention=(arch.norm_in_attention
                                                      and cfg.model.deferred_norms))
    return arch


def _model_architecture(cfg: RecipeConfig | None, model: str | None) -> Architecture:
    """`recipe_architecture` as the model's config says it (fused norms where supported)."""
    if model is not None:
        return _architecture_of_path(model)
    if cfg is None:
        raise UserError("no model to estimate: pass a recipe or --model with a preset "
                        f"({', '.join(sorted(PRESETS))}) or a config.json")
    if cfg.model.random_init:
        return from_config_dict(cfg.model.config, name=cfg.model.config.get("model_type"))
    if is_placeholder(cfg.model.path):
        raise UserError(f"model.path is still the placeholder {cfg.model.path!r}; set it with "
                        f"--set model.path=FOLDER, or size the recipe with --model and a preset "
                        f"({', '.join(sorted(PRESETS))})")
    return _architecture_of_path(cfg.model.path)


def _architecture_of_path(path: str) -> Architecture:
    """A preset or an existing local folder / config.json (whose faults are reported as they
    are: a local path is never looked up on the hub), else a hub name through transformers
    (online or cached)."""
    if path in PRESETS or os.path.exists(os.path.expanduser(path)):
        return load_architecture(path)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path).to_dict()
    except (OSError, ValueError) as exc:
        raise UserError(f"model {path!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                        f"config.json or a model folder, and the hub did not give its config "
                        f"({exc.__class__.__name__}: offline or an unknown name); pass one of "
                        "those") from None
    return from_config_dict(config, name=path)


def plan_recipe(cfg: RecipeConfig | None, *, model: str | None = None, gpus: int,
                gpu_memory: int, host_memory: int | None, gpus_per_node: int | None = None,
                seq_len: int | None = None) -> dict:
    """Plan a recipe on a machine (what ``lctrain estimate-memory --plan`` calls): the longest
    sequence and its settings, and the fastest settings at ``seq_len`` (`lctrain.memory.plan`).

    The recipe's model, dtypes, batch size, accumulation, loss chunks, LoRA and schedule layout
    are kept; cp, checkpointing, tiles, head groups and state placement are what is planned.

    Args:
        cfg: the recipe (None: the recipe defaults around ``model``).
        model: a preset, config.json or model folder instead of the recipe's model.
        gpus, gpu_memory: GPUs in the job and bytes per GPU.
        host_memory: host bytes per machine (None: plan nothing into host memory).
        gpus_per_node: GPU processes per machine (default: min(gpus, 8)).
        seq_len: a length to find the fastest settings for (None: the longest only).

    Returns:
        `lctrain.memory.plan.plan`'s JSON-ready result, plus the machine it assumed.

    Raises:
        UserError: no model to plan, or an unreadable model config.
    """
    from lctrain.memory.estimate import Setup
    from lctrain.memory.plan import Machine, plan

    arch = recipe_architecture(cfg, model)
    parallel = cfg.parallel if cfg is not None else ParallelConfig()
    train = cfg.train if cfg is not None else TrainConfig()
    master = cfg.model.dtype if cfg is not None else "float32"
    compute = "bfloat16" if train.mixed_precision in ("auto", "bf16") else master
    base = Setup(arch=arch, gpus=gpus, cp=1, policy="none", dtype=compute, master_dtype=master,
                 batch_size=train.batch_size, grad_accum=train.grad_accum,
                 fsdp=_FSDP[parallel.fsdp], loss_chunk_tokens=train.loss_chunk_tokens,
                 lora=lora_shape(cfg.lora) if cfg is not None else None)
    machine = Machine(gpus=gpus, gpu_memory=gpu_memory, host_memory=host_memory,
                      gpus_per_node=gpus_per_node or min(gpus, 8))
    return plan(base, machine, lambda cp: seq_chunks(cp, parallel.layout), seq_len)
