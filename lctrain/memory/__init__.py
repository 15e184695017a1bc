"""Analytic per-GPU memory model behind ``lctrain estimate-memory``.

    from lctrain.memory import estimate_recipe, estimate, load_architecture
    est = estimate_recipe(cfg, model=None, seq_len=256 * 1024, gpus=8, gpu_memory=80 << 30,
                          cp=None, policy=None)
    est.to_json()   # parameters_count, per_gpu_bytes{...,total}, fits, max_seq_len
    estimate_table(est.to_json())   # a lctrain.report.table.Table

    plan_recipe(cfg, model=None, gpus=2, gpu_memory=139 << 30, host_memory=251 << 30,
                seq_len=1 << 20)   # the longest run, the fastest at a length (lctrain.memory.plan)

Low level: ``estimate(load_architecture("llama-7b"), seq_len, gpus, cp, "remat", "bfloat16")``.
"""
from lctrain.memory.activations import POLICIES
from lctrain.memory.arch import Architecture, from_config_dict, load_architecture
from lctrain.memory.estimate import HOST_USABLE, estimate, host_offload_fits, max_seq_len
from lctrain.memory.lora import LoraShape, lora_shape
from lctrain.memory.presets import PRESETS
from lctrain.memory.recipe import estimate_recipe, plan_recipe, recipe_architecture
from lctrain.memory.report import MemoryEstimate, estimate_table

__all__ = ["HOST_USABLE", "POLICIES", "PRESETS", "Architecture", "LoraShape", "MemoryEstimate",
           "estimate", "estimate_recipe", "estimate_table", "from_config_dict", "host_offload_fits",
           "load_architecture", "lora_shape", "max_seq_len", "plan_recipe", "recipe_architecture"]
