"""Built-in architectures (shapes only) for ``estimate-memory --model NAME``: each is the
architecture part of the model's published ``config.json``."""
from __future__ import annotations

_SHARED = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "hidden_act": "silu", "tie_word_embeddings": False}
_LLAMA3 = {**_SHARED, "model_type": "llama", "vocab_size": 128256, "intermediate_size": 14336,
           "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0}
_MISTRAL = {**_SHARED, "model_type": "mistral", "vocab_size": 32000, "intermediate_size": 14336,
            "num_key_value_heads": 8, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "sliding_window": 4096}

PRESETS: dict[str, dict] = {
    "llama-7b": {**_SHARED, "model_type": "llama", "vocab_size": 32000,
                 "intermediate_size": 11008, "num_key_value_heads": 32,
                 "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "llama3-8b": _LLAMA3,
    "llama3.1-8b": {**_LLAMA3, "max_position_embeddings": 131072, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}},
    "mistral-7b": _MISTRAL,
    "mistral-7b-v0.3": {**_MISTRAL, "vocab_size": 32768, "rope_theta": 1000000.0,
                        "sliding_window": None},
    "qwen2.5-7b": {**_SHARED, "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "max_position_embeddings": 131072,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False},
    "qwen3-8b": {**_SHARED, "model_type": "qwen3", "vocab_size": 151936,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "num_key_value_heads": 8,
                 "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0},
}
"""Preset name -> transformers config fields (architecture only)."""
