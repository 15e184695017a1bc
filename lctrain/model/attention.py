"""The "lctrain" attention for transformers models, registered through `AttentionInterface`.

`lctrain_attention` gets q (B, Hq, S, D) and k, v (B, Hkv, S, D) after RoPE, K/V heads not
repeated. The call's ``cp_context`` keyword (transformers passes unknown keywords down) says how it
is distributed: over a group of several ranks, each holding its shard of the sequence,
`lctrain_kernels.dist_attention` computes exact causal attention; without one, local causal
attention runs. Position ids must be the GLOBAL ones of each token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lctrain.model.features import check_attention_call

ATTENTION_NAME = "lctrain"


@dataclass(frozen=True)
class CPContext:
    """How one forward call's attention is distributed: the cp ``group`` (None or size 1:
    local), the GLOBAL document bounds (0, ..., seq_len) on every rank (None: one causal sequence
    per row), the schedule whose layout the shards are in, the local backend, and the head groups
    run one after the other (bounding the buffers)."""

    group: Any = None
    cu_seqlens: Any = None
    schedule: str = "distflash"
    backend: str = "auto"
    head_groups: int = 1

    def global_len(self, local_len: int) -> int:
        """Tokens of the whole sequence: every rank of ``group`` holds ``local_len`` of them."""
        return local_len if self.group is None else local_len * dist.get_world_size(self.group)


def lctrain_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function backed by lctrain_kernels: query (B, Hq, S_local, D),
    key and value (B, Hkv, S_local, D) after RoPE, no mask, no dropout, ``cp_context`` when the
    call is distributed or has documents; returns (out (B, S_local, Hq, D), None). A call that
    asks for more than exact causal attention is a ConfigError naming the setting."""
    import lctrain_kernels

    ctx = kwargs.get("cp_context") or CPContext()
    check_attention_call(module, (query.shape[-1], value.shape[-1]), attention_mask, dropout,
                         kwargs, ctx.global_len(query.shape[2]))
    # one dtype: autocast's under autocast (as autocast does to SDPA: RoPE's float32 tables make
    # q and k float32 there), else the promoted one
    device = query.device.type
    dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else
             torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype))
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (query, key, value))  # (B, S, H, D)
    options = dict(causal=True, cu_seqlens=ctx.cu_seqlens, softmax_scale=scaling,
                   backend=ctx.backend, head_groups=ctx.head_groups)
    if ctx.group is None:  # one rank: no schedule, so no layout's rule on the length
        return lctrain_kernels.attention(q, k, v, **options), None  # (B, S, Hq, D)
    return lctrain_kernels.dist_attention(q, k, v, group=ctx.group, schedule=ctx.schedule,
                                          **options), None


def register_attention() -> str:
    """Register the "lctrain" attention in transformers' AttentionInterface (idempotent);
    returns the name to pass as ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, lctrain_attention)
    return ATTENTION_NAME
