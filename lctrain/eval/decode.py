"""Greedy decoding after a distributed prefill, the prompt's keys and values left where they were
computed (gathering a long prompt's keys onto one rank fits no GPU).

The **prefill** runs like a training forward over the cp group, each rank keeping its shard's keys
and values per layer (`KVShards`). In **decoding** every rank attends the new token to the keys it
holds (cp rank 0 also to the generated ones, so no key counts twice); the partial outputs and lses
are all-gathered and merged in float32: exactly attention over all keys. cp rank 0's greedy choice
is broadcast so the ranks cannot drift apart. Without a ``lctrain_kv`` keyword the attention
registered here (``lctrain_eval``) IS the "lctrain" attention, so one model serves ppl runs too."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lctrain.model.attention import lctrain_attention

ATTENTION_NAME = "lctrain_eval"  # the ``attn_implementation`` of models `lctrain eval` builds


class KVShards:
    """The keys and values one rank keeps for decoding, per attention module, over the cp ``group``
    (None: one rank holds the whole prompt): ``prompt`` (this rank's shard) and ``tail`` (the
    generated tokens), module -> (k, v) (B, Hkv, S, D); ``decoding`` once the prompt ran."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.owns_tail = group is None or dist.get_rank(group) == 0
        self.prompt: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tail: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decoding = False

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Attention of a new token's query (B, Hq, 1, D) over every key so far, with its key
        and value (B, Hkv, 1, D), in the prompt keys' dtype; ``module`` says which layer.
        Returns (B, 1, Hq, D), the same on every rank of the group."""
        from lctrain_kernels.api import MaskSpec, block_forward

        keys, values = self.prompt[module]  # (B, Hkv, S_local, D)
        query, key, value = query.to(keys.dtype), key.to(keys.dtype), value.to(keys.dtype)
        old = self.tail.get(module)
        self.tail[module] = tail = (key, value) if old is None else (
            torch.cat([old[0], key], dim=2), torch.cat([old[1], value], dim=2))
        q = query.transpose(1, 2)  # (B, 1, Hq, D)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        # every key precedes the query: full (unmasked) blocks, in float32 math
        held = [(keys, values)] + ([tail] if self.owns_tail else [])
        out, lse = _merged([block_forward(q, k.transpose(1, 2), v.transpose(1, 2),
                                          MaskSpec(causal=False), scale=scale,
                                          backend="reference") for k, v in held])
        if self.size > 1:
            outs = [torch.empty_like(out) for _ in range(self.size)]  # (B, 1, Hq, D) each
            lses = [torch.empty_like(lse) for _ in range(self.size)]  # (B, Hq, 1) each
            dist.all_gather(outs, out.contiguous(), group=self.group)
            dist.all_gather(lses, lse.contiguous(), group=self.group)
            out, lse = _merged(list(zip(outs, lses)))
        return out.to(q.dtype)


def _merged(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attentions of the same query over disjoint keys, merged in float32."""
    from lctrain_kernels.api import merge

    out, lse = parts[0][0].float(), parts[0][1].float()
    for other, other_lse in parts[1:]:
        out, lse = merge(out, lse, other, other_lse)
    return out, lse


def eval_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   scaling: float | None = None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function of evaluated models: `lctrain_attention`, and with
    ``lctrain_kv`` (a `KVShards`) a prefill that keeps its keys and values, or a decoding step.
    Returns (out (B, S_local, Hq, D), None)."""
    kv: KVShards | None = kwargs.get("lctrain_kv")
    if kv is not None and kv.decoding:  # the prefill already checked what this layer asks for
        return kv.attend(module, query, key, value, scaling), None
    out, _ = lctrain_attention(module, query, key, value, attention_mask, scaling, dropout,
                               **kwargs)
    if kv is not None:  # this rank's prompt keys, kept in the dtype attention computed in
        kv.prompt[module] = (key.detach().to(out.dtype), value.detach().to(out.dtype))
    return out, None


def register_eval_attention() -> str:
    """Register ``lctrain_eval`` in transformers' AttentionInterface (idempotent); returns the
    name to pass as ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, eval_attention)
    return ATTENTION_NAME


def pick_token(logits: torch.Tensor, group: Any, vocab: int | None = None) -> torch.Tensor:
    """Greedy next tokens (B, 1) from (B, V) logits, the same on every rank of ``group``: cp
    rank 0's argmax among the first ``vocab`` ids (a tokenizer smaller than the model's
    embedding cannot write the others; None: all V)."""
    token = logits[:, :vocab].argmax(dim=-1, keepdim=True)  # (B, 1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
    return token


def generate(module: torch.nn.Module, prompt: list[int], steps: int, *, cp, accelerator,
             keep_logits: bool = False, vocab: int | None = None
             ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation of ``prompt`` (a length that suits the cp layout) by ``steps`` ≥ 1 tokens
    of ids below ``vocab``, by the distributed `EvalModel` ``module`` (collective over the cp
    group). Returns (generated ids, per-step (V,) float32 host logits if ``keep_logits``)."""
    from lctrain.data import PackedBatch

    length = len(prompt)
    ids = torch.tensor([prompt], dtype=torch.long)  # (1, L)
    shard = cp.shard(PackedBatch(ids, torch.full_like(ids, -100), torch.arange(length)[None], None))
    group = cp.mesh.cp_group
    kv = KVShards(group)
    tokens, kept = [], []
    with torch.no_grad():
        with accelerator.autocast():
            logits = module(shard.input_ids, shard.position_ids, cp_context=cp.context(shard),
                            kv=kv, at=length - 1)  # (1, V), zeros where L-1 is not held
        if group is not None:
            dist.all_reduce(logits, group=group)
        kv.decoding = True
        for step in range(steps):
            if keep_logits:
                kept.append(logits[0].cpu())
            token = pick_token(logits, group, vocab)  # (1, 1)
            tokens.append(token)
            if step + 1 == steps:
                break
            position = torch.full((1, 1), length + step, dtype=torch.long, device=token.device)
            with accelerator.autocast():
                logits = module(token, position, kv=kv, at=length + step)
    return torch.cat(tokens, dim=1)[0].tolist(), kept
