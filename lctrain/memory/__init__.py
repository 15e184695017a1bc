"""Analytic per-GPU memory model behind ``lctrain estimate-memory``:
``estimate_recipe(cfg, seq_len=..., gpus=8, gpu_memory=80 << 30)``, ``plan_recipe`` (the
planner) and ``estimate(load_architecture("llama-7b"), seq_len, gpus, cp, "remat")``."""
from lctrain.memory.arch import Architecture, from_config_dict, load_architecture
from lctrain.memory.estimate import HOST_USABLE, estimate, host_offload_fits, max_seq_len
from lctrain.memory.adapters import LoraShape, lora_shape
from lctrain.memory.presets import PRESETS
from lctrain.memory.recipe import estimate_recipe, placed_layers, plan_recipe, recipe_architecture
from lctrain.memory.tables import MemoryEstimate, estimate_table
