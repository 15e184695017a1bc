"""`estimate_recipe`: the memory model applied to a recipe (what ``lctrain estimate-memory`` calls)."""
from __future__ import annotations

from lctrain.config.paths import is_placeholder
from lctrain.config.schema import ParallelConfig, RecipeConfig, TrainConfig
from lctrain.errors import UserError
from lctrain.memory.arch import Architecture, from_config_dict, load_architecture
from lctrain.memory.estimate import estimate
from lctrain.memory.lora import lora_shape
from lctrain.memory.presets import PRESETS
from lctrain.memory.report import MemoryEstimate
from lctrain_kernels.vocabulary import seq_chunks


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
        policy: checkpointing policy (default: the recipe's train.checkpointing).
        host_memory, gpus_per_node: host bytes and GPU processes per machine, to check
            remat-offload's pinned memory too (see `lctrain.memory.estimate`).

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
    return estimate(arch, seq_len, gpus, cp, policy or train.checkpointing, compute,
                    master_dtype=master, batch_size=train.batch_size,
                    grad_accum=train.grad_accum, fsdp=parallel.fsdp != "off",
                    loss_chunk_tokens=train.loss_chunk_tokens, gpu_memory=gpu_memory,
                    seq_chunks=seq_chunks(cp, parallel.layout),
                    host_memory=host_memory, gpus_per_node=gpus_per_node,
                    lora=lora_shape(cfg.lora) if cfg is not None else None)


def recipe_architecture(cfg: RecipeConfig | None, model: str | None = None) -> Architecture:
    """The architecture to estimate: ``model`` (preset, config.json, folder) if given, else the
    recipe's model.path (a hub name is read through transformers; model.config overrides cannot
    change its shapes) or its random-init model.config.

    Raises:
        UserError: nothing to read an architecture from (model.path still a placeholder), or an
            unreadable config.
    """
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
    """A local folder / config.json, else a hub name through transformers (online or cached)."""
    try:
        return load_architecture(path)
    except UserError:
        pass
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path).to_dict()
    except (OSError, ValueError) as exc:
        from lctrain.memory.presets import PRESETS

        raise UserError(f"model {path!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                        f"config.json or a model folder, and the hub did not give its config "
                        f"({exc.__class__.__name__}: offline or an unknown name); pass one of "
                        "those") from None
    return from_config_dict(config, name=path)
