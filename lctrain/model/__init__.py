"""The model: load or build a causal LM, with lctrain's attention swapped in from outside.

    from lctrain.model import load_model, CPContext
    model = load_model("path/or/hub-name", config=None, seed=0)       # attn "lctrain"
    model = load_model("/models/Llama-3.1-8B", seed=0, seq_len=131072,  # overrides on top
                       config={"rope_parameters": {"rope_type": "llama3", "factor": 16.0}})
    hidden = model.get_decoder()(input_ids=ids, position_ids=global_pos,
                                 cp_context=CPContext(group=cp_group, cu_seqlens=cu))

`check_model(cfg)` runs every check of a recipe's model (config, features, weights present)
before any weight loads; `resolve_config` gives the transformers config a run trains.
"""
from lctrain.model.attention import ATTENTION_NAME, CPContext, lctrain_attention, register_attention
from lctrain.model.features import check_model_config
from lctrain.model.hf_config import resolve_config
from lctrain.model.load import check_model, load_model, load_tokenizer

__all__ = ["ATTENTION_NAME", "CPContext", "check_model", "check_model_config", "lctrain_attention",
           "load_model", "load_tokenizer", "register_attention", "resolve_config"]
