"""Attention modules run one head group at a time, the norm before them, projections and RoPE
included (`lctrain_kernels.api.attention_block`), so q, k, v, their gradients and the norm's
output are never held for every head at once. It applies (after LoRA, before checkpointing and
FSDP2) to ``grouped`` families' modules with plain ``nn.Linear`` projections when the model runs
lctrain's attention; a call with a KV cache runs the norm and the module as they are."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from lctrain.model.attention import ATTENTION_NAME, CPContext
from lctrain.model.families import family
from lctrain.model.features import check_attention_call
from lctrain.model.structure import DeferredNorm, bare, decoder_layers

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def supported(module: nn.Module, model_type: str) -> bool:
    """Whether ``module`` (an attention module of a ``model_type`` model) can run grouped."""
    config = getattr(module, "config", None)
    return (getattr(family(model_type), "grouped", False)
            and getattr(config, "_attn_implementation", None) == ATTENTION_NAME
            and all(type(getattr(module, name, None)) is nn.Linear for name in _PROJECTIONS)
            and isinstance(getattr(module, "head_dim", None), int))


def apply_grouped_attention(model: nn.Module, head_groups: int, fused_rope: bool = False,
                            defer_norm: bool = True) -> int:
    """Run every supported attention module of ``model`` (with ``defer_norm``, the norm before
    it too: `lctrain.model.structure.DeferredNorm`) in ``head_groups`` groups, in place. Calling
    it again replaces the group count; fewer than 2 groups unwraps. ``fused_rope``: rotate with
    the RoPE kernel (CUDA tensors). Returns the number of attention modules wrapped."""
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    wrapped = 0
    for layer in decoder_layers(model):
        layer = bare(layer)
        attn = getattr(layer, "self_attn", None)
        norm = getattr(layer, "input_layernorm", None)
        if not isinstance(attn, nn.Module) or not isinstance(norm, nn.Module):
            continue
        inner, norm = bare(attn), bare(norm)
        if head_groups >= 2 and supported(inner, model_type):
            layer.self_attn = GroupedAttention(inner, head_groups, fused_rope,
                                               norm if defer_norm else None)
            layer.input_layernorm = DeferredNorm(norm) if defer_norm else norm
            wrapped += 1
        else:
            layer.self_attn, layer.input_layernorm = inner, norm
    return wrapped


class GroupedAttention(ActivationWrapper):
    """A Llama-family attention module run one head group at a time; given ``norm``, the
    layer's norm before it runs inside too, and it takes the layer's input. Parameter names,
    ``state_dict()`` and distributed checkpoints read as without it."""

    def __init__(self, module: nn.Module, head_groups: int, fused_rope: bool = False,
                 norm: nn.Module | None = None) -> None:
        super().__init__(module)
        kv = module.config.num_key_value_heads
        if head_groups < 1 or kv % head_groups:
            raise ValueError(f"head_groups must be a positive divisor of the {kv} key/value "
                             f"heads, got {head_groups}")
        self.head_groups, self.fused_rope = int(head_groups), bool(fused_rope)
        self.__dict__["norm"] = norm  # not a child of this module: it stays in its layer

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                **kwargs):
        from lctrain_kernels.api import attention_block

        attn, norm = self._checkpoint_wrapped_module, self.norm
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None or position_embeddings is None:
            x = hidden_states if norm is None else norm(hidden_states)
            return attn(x, position_embeddings=position_embeddings,
                        attention_mask=attention_mask, **kwargs)
        d, ctx = attn.head_dim, kwargs.get("cp_context") or CPContext()
        dropout = attn.attention_dropout if attn.training else 0.0
        check_attention_call(attn, (d, d), attention_mask, dropout, kwargs,
                             ctx.global_len(hidden_states.shape[1]))  # (B, S, hidden)
        y = attention_block(hidden_states, [getattr(attn, n).weight for n in _PROJECTIONS],
                            [getattr(attn, n).bias for n in _PROJECTIONS], *position_embeddings,
                            d, norm=norm, softmax_scale=attn.scaling,
                            head_groups=self.head_groups, fused_rope=self.fused_rope,
                            group=ctx.group, cu_seqlens=ctx.cu_seqlens, schedule=ctx.schedule,
                            backend=ctx.backend)
        return y, None

    def extra_repr(self) -> str:
        return f"head_groups={self.head_groups}"
