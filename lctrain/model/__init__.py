"""The model: load or build a causal LM, with lctrain's attention swapped in from outside.

    from lctrain.model import load_model, CPContext
    model = load_model("path/or/hub-name", config=None, seed=0)       # attn "lctrain"
    hidden = model.get_decoder()(input_ids=ids, position_ids=global_pos,
                                 cp_context=CPContext(group=cp_group, cu_seqlens=cu))
"""
from lctrain.model.attention import ATTENTION_NAME, CPContext, lctrain_attention, register_attention
from lctrain.model.load import load_model

__all__ = ["ATTENTION_NAME", "CPContext", "lctrain_attention", "load_model", "register_attention"]
