"""The memory model applied to a recipe: what ``lctrain estimate-memory`` and the runner call."""
from __future__ import annotations

import dataclasses
import json
import os

from lctrain.config.fields import format_tokens
from lctrain.config.layers import LayerPlan
from lctrain.config.paths import is_placeholder
from lctrain.config.schema import ParallelConfig, RecipeConfig, TrainConfig
from lctrain.errors import UserError
from lctrain.memory.arch import Architecture, from_config_dict, load_architecture
from lctrain.memory.estimate import Setup, check_gpus_per_node, divisors, estimate
from lctrain.memory.adapters import lora_shape
from lctrain.memory.presets import PRESETS
from lctrain.memory.tables import MemoryEstimate
from lctrain_kernels.vocabulary import check_seq_len, seq_chunks

_FSDP = {"auto": True, "on": "on", "off": False}
"""parallel.fsdp -> the memory model's ``fsdp`` (auto: FSDP2 on several GPUs; on: always)."""


def _sections(cfg: RecipeConfig | None) -> tuple[ParallelConfig, TrainConfig, dict]:
    """(parallel, train, `Setup`'s fields both an estimate and a plan take from them) of a
    recipe, or the defaults."""
    parallel, train, master = ((ParallelConfig(), TrainConfig(), "float32") if cfg is None
                               else (cfg.parallel, cfg.train, cfg.model.dtype))
    return parallel, train, {
        "dtype": "bfloat16" if train.mixed_precision in ("auto", "bf16") else master,
        "master_dtype": master, "batch_size": train.batch_size, "grad_accum": train.grad_accum,
        "fsdp": _FSDP[parallel.fsdp], "loss_chunk_tokens": train.loss_chunk_tokens,
        "lora": lora_shape(cfg.lora) if cfg is not None else None}


def estimate_recipe(cfg: RecipeConfig | None, *, model: str | None = None, seq_len: int,
                    gpus: int, gpu_memory: int, cp: int | None = None,
                    checkpointing: str | None = None, host_memory: int | None = None,
                    gpus_per_node: int | None = None, attended: float = 1.0) -> MemoryEstimate:
    """Per-GPU memory of a recipe (None: defaults around ``model``, with checkpointing auto and
    the smallest cp that fits unless given, said in ``assumptions``), its step time for rows
    that attend ``attended`` of a one-document row (`Setup`); UserError: no model."""
    arch = recipe_architecture(cfg, model)
    parallel, train, fields = _sections(cfg)
    assumptions = []
    if cfg is None and checkpointing is None:  # what one runs at a long length
        checkpointing = "auto"
        assumptions.append("checkpointing auto: placed for this memory (--checkpointing to "
                           "choose)")
    layers = train.layers if checkpointing is None else LayerPlan.parse(checkpointing, train.offload)

    def run(cp: int) -> MemoryEstimate:
        return estimate(arch, seq_len, gpus, cp, layers, **fields, gpu_memory=gpu_memory,
                        seq_chunks=seq_chunks(cp, parallel.layout), host_memory=host_memory,
                        gpus_per_node=gpus_per_node, tile_tokens=train.tile_tokens,
                        head_groups=parallel.head_groups, attended=attended)

    if cfg is not None or cp is not None:
        return dataclasses.replace(run(parallel.cp if cp is None else cp), assumptions=assumptions)
    sizes = [d for d in divisors(gpus) if seq_len % seq_chunks(d, parallel.layout) == 0] or [1]
    result, length = next((r for r in map(run, sizes) if r.fits), None), format_tokens(seq_len)
    why = (f"the smallest that fits {length} tokens on {gpus} GPUs" if result is not None else
           f"all {gpus} GPUs, as none fits {length} tokens")
    result = result or run(sizes[-1])
    assumptions.insert(0, f"cp {result.cp}: {why} (--cp to choose)")
    return dataclasses.replace(result, assumptions=assumptions)


def placed_layers(cfg: RecipeConfig, *, gpus: int, gpu_memory: int, host_memory: int | None,
                  gpus_per_node: int) -> LayerPlan:
    """The recipe's layer plan with ``auto`` placed for this GPU and host memory."""
    if not cfg.train.layers.auto:
        return cfg.train.layers
    est = estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=gpus, gpu_memory=gpu_memory,
                          host_memory=host_memory, gpus_per_node=gpus_per_node)
    return LayerPlan.parse(est.details["checkpointing"], est.details["offload"])


def recipe_architecture(cfg: RecipeConfig | None, model: str | None = None) -> Architecture:
    """The architecture to estimate: ``model``, or the recipe's (UserError: none to read)."""
    if model is not None:
        arch = load_architecture(model)
    elif cfg is None:
        raise UserError("no model to estimate: pass a recipe or --model with a preset "
                        f"({', '.join(sorted(PRESETS))}) or a config.json")
    elif cfg.model.random_init:
        arch = from_config_dict(cfg.model.config, name=cfg.model.config.get("model_type"))
    elif is_placeholder(cfg.model.path):
        raise UserError(f"model.path is still the placeholder {cfg.model.path!r}; set it with "
                        f"--set model.path=FOLDER, or size the recipe with --model and a preset "
                        f"({', '.join(sorted(PRESETS))})")
    else:
        arch = load_architecture(cfg.model.path)
    if cfg is not None and not cfg.model.fused_kernels:
        arch = dataclasses.replace(arch, fused_norms=False, fused_mlp=False, fused_loss=False,
                                   grouped_attention=False, norm_in_tiles=False,
                                   norm_in_attention=False)
    return arch


def plan_recipe(cfg: RecipeConfig | None, *, model: str | None = None, gpus: int,
                gpu_memory: int, host_memory: int | None, gpus_per_node: int | None = None,
                seq_len: int | None = None, attended: float = 1.0) -> dict:
    """Plan a recipe on a machine (`lctrain.memory.plan`), its fastest choice at ``seq_len``
    ranked for rows that attend ``attended`` of one document; UserError: no model to plan."""
    from lctrain.memory.plan import Machine, plan

    parallel, _, fields = _sections(cfg)
    check_gpus_per_node(gpus, gpus_per_node)
    if seq_len is not None and seq_len < 2:
        raise UserError(f"sequence length {seq_len} is too short to train; give at least 2")
    if seq_len is not None:  # a length no cp cuts (cp 1 cuts the most) is an error, not a misfit
        try:
            check_seq_len(seq_len, 1, parallel.layout, what="sequence length", ranks="cp 1")
        except ValueError as exc:
            raise UserError(str(exc)) from None
    base = Setup(arch=recipe_architecture(cfg, model), gpus=gpus, cp=1, attended=attended,
                 **fields)
    machine = Machine(gpus=gpus, gpu_memory=gpu_memory, host_memory=host_memory,
                      gpus_per_node=gpus_per_node or min(gpus, 8))
    return plan(base, machine, lambda cp: seq_chunks(cp, parallel.layout), seq_len)


_PLAN_DEFAULTS = ("model.dtype", "train.mixed_precision", "train.batch_size", "train.grad_accum",
                  "train.loss_chunk_tokens", "parallel.fsdp", "parallel.schedule", "train.lr")
"""What a plan without a recipe takes at its default (`_sections`; and a fine-tuning rate)."""


def run_settings(cfg: RecipeConfig | None, recipe: str | None, model: str | None) -> list[str]:
    """The ``--set`` items that make ``lctrain finetune [recipe]`` train what a plan for it and
    ``model`` sized (without a recipe: the embedded one with the defaults the plan assumed)."""
    items = []
    if model is not None and model not in PRESETS:
        local = os.path.expanduser(model)
        items.append(f"model.path={os.path.dirname(model) or '.' if os.path.isfile(local) else model}")
        if cfg is None or cfg.model.path is None:
            items.append("model.config=null")
        if cfg is None or cfg.data.tokenizer in ("bytes", "byte-pairs"):
            items.append("data.tokenizer=null")
    if model in PRESETS:  # the preset's shape in place of the recipe's model
        items.append(f"model.config={json.dumps(PRESETS[model])}")
        if cfg is not None and cfg.model.path is not None:
            items.append("model.path=null")
    if recipe is not None:
        return items
    from lctrain.config import load_recipe

    embedded = load_recipe(None)
    for key in _PLAN_DEFAULTS:
        section, name = key.split(".")
        default = next(f.default for f in dataclasses.fields(getattr(embedded, section))
                       if f.name == name)
        if getattr(getattr(embedded, section), name) != default:
            items.append(f"{key}={default}")
    return items
