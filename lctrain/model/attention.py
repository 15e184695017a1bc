"""The "lctrain" attention for transformers models, registered through `AttentionInterface`.

A transformers model calls its attention function with query (B, Hq, S, D) and key/value
(B, Hkv, S, D) after RoPE, with K/V heads NOT repeated. This module swaps that function for
lctrain's kernels without touching any private transformers code:

- the model is built (or switched) with ``attn_implementation="lctrain"``;
- each forward call passes ``cp_context=CPContext(...)`` as a keyword argument of the model
  call; transformers forwards unknown keyword arguments down to every attention call;
- with a context whose group spans several ranks, every rank holds only its shard of the
  sequence (in the schedule's layout) and `lctrain_kernels.dist_attention` computes exact causal
  attention over the whole sequence; without a context, plain local causal attention runs.

The model never learns that it is parallel: the context travels with the call, not in globals.
Position ids must be the GLOBAL ones of each token (the loop passes them); transformers would
otherwise number every shard from 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lctrain.model.features import check_attention_call

ATTENTION_NAME = "lctrain"


@dataclass(frozen=True)
class CPContext:
    """How one forward call's attention is distributed.

    Attributes:
        group: the context-parallel process group (None or size 1: local attention).
        cu_seqlens: document boundaries as GLOBAL positions (0, ..., seq_len), identical on every
            rank of the group, or None for one causal sequence per row.
        schedule: distributed schedule kind ("distflash", "ring", "zigzag"); the shards must be
            in that schedule's layout. (torch's own ring, the ``context_parallel`` peer, runs
            through its own attention function: `lctrain.parallel.torch_cp`.)
        backend: local attention backend name ("auto", "reference", "triton", ...).
        head_groups: run the heads in this many groups one after the other (a divisor of the
            key/value heads), which bounds the attention's buffers; same results.
    """

    group: Any = None
    cu_seqlens: Any = None
    schedule: str = "distflash"
    backend: str = "auto"
    head_groups: int = 1


def lctrain_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function backed by lctrain_kernels.

    Args:
        module: the calling attention module (only checked for unsupported features).
        query: (B, Hq, S_local, D), RoPE applied.
        key, value: (B, Hkv, S_local, D), RoPE applied to key, heads not repeated.
        attention_mask: must be None: causality and documents come from the kernel and
            ``cp_context.cu_seqlens``.
        scaling: softmax scale (default 1/sqrt(D)).
        dropout: must be 0.
        **kwargs: ``cp_context`` (a `CPContext`) when the call is distributed or has documents.

    Returns:
        (out (B, S_local, Hq, D), None).

    Raises:
        ConfigError: the call asks for more than exact causal attention (dropout, a window
            shorter than the sequence, soft-capping, sinks, a bias, an explicit mask, ...);
            `lctrain.model.features` names the setting.
    """
    import lctrain_kernels

    query, key, value = checked_inputs(module, query, key, value, attention_mask, dropout,
                                       kwargs)
    q = query.transpose(1, 2)  # (B, S, Hq, D)
    k = key.transpose(1, 2)  # (B, S, Hkv, D)
    v = value.transpose(1, 2)  # (B, S, Hkv, D)
    ctx = kwargs.get("cp_context")
    if ctx is None:
        out = lctrain_kernels.attention(q, k, v, causal=True, softmax_scale=scaling)
    elif ctx.group is None:
        out = lctrain_kernels.attention(q, k, v, causal=True, cu_seqlens=ctx.cu_seqlens,
                                        softmax_scale=scaling, backend=ctx.backend,
                                        head_groups=ctx.head_groups)
    else:
        out = lctrain_kernels.dist_attention(q, k, v, group=ctx.group, causal=True,
                                             cu_seqlens=ctx.cu_seqlens, softmax_scale=scaling,
                                             schedule=ctx.schedule, backend=ctx.backend,
                                             head_groups=ctx.head_groups)
    return out, None  # (B, S, Hq, D)


def checked_inputs(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float,
                   kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every attention function lctrain registers does first: refuse what it cannot honour,
    then bring q, k, v to the one dtype attention computes in.

    Raises:
        ConfigError: the call asks for more than exact causal attention
            (`lctrain.model.features.check_attention_call` names the setting).
    """
    check_attention_call(module, query, value, attention_mask, dropout, kwargs,
                         global_len(query.shape[2], kwargs.get("cp_context")))
    return _one_dtype(query, key, value)


def _one_dtype(query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in the dtype attention computes in, as SDPA does under autocast.

    With float32 parameters under bf16 autocast, the projections come out in bf16 but RoPE
    multiplies q and k by float32 cos/sin, so q and k arrive in float32 and v in bf16. Under
    autocast all three go to the autocast dtype (what autocast does to SDPA); otherwise
    mismatched inputs meet in their promoted dtype.
    """
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def global_len(local_len: int, ctx: CPContext | None) -> int:
    """Tokens of the whole sequence: every rank of the cp group holds ``local_len`` of them."""
    if ctx is None or ctx.group is None:
        return local_len
    import torch.distributed as dist

    return local_len * dist.get_world_size(ctx.group)


def register_attention() -> str:
    """Register the "lctrain" attention in transformers' AttentionInterface (idempotent).

    Returns:
        The name to pass as ``attn_implementation``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, lctrain_attention)
    return ATTENTION_NAME
