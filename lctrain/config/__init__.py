"""Typed, frozen recipe configuration; YAML is only how it is stored.

    cfg = load_recipe("llama-7b-64k", ["train.lr=1e-5"], seq_len="128k")
    save_resolved(cfg, "runs/x/config.yaml")"""
from lctrain.config.layers import LayerPlan
from lctrain.config.loader import REMOVED, build_recipe, load_recipe, read_resolved, save_resolved
from lctrain.config.paths import is_placeholder, local_data, require_model_path, shipped_recipes
from lctrain.config.resume import check_run_folder, load_resumed
from lctrain.config.schema import (BYTE_PAIR_TOKENIZER_VOCAB, BYTE_TOKENIZER_VOCAB, DataConfig,
                                   LoraConfig, ModelConfig, ParallelConfig, RecipeConfig,
                                   TrainConfig)
from lctrain.config.fields import (format_bytes, format_tokens, parse_memory, parse_size,
                                  parse_size_list)
from lctrain.errors import ConfigError
