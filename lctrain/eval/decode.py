"""Greedy decoding after a distributed prefill, with the prompt's keys and values left where
they were computed.

Why this design. At 256K tokens the keys and values of a 7B model with 32 key/value heads
(Llama-2-7B) take 2 × 256K × 32 × 128 × 2 bytes = 4 GiB per layer, 128 GiB over its 32 layers:
gathering them onto one rank does not fit any GPU, and re-running the prompt without the cp
group would need the whole sequence's attention on one GPU for every generated token. So:

- **prefill** runs exactly like a training forward: every cp rank holds its shard of the prompt
  (in the schedule's layout) and the attention is `lctrain_kernels.dist_attention` over the cp
  group. On the way, each rank keeps the keys and values of ITS shard, per layer
  (`KVShards`): (prompt / cp) tokens, about what remat keeps per layer in a training step at
  the same length. The next-token logits come from the rank holding the last position and
  are summed over the cp group (the others contribute zeros): one vector, never the logits
  of the whole prompt.
- **decode**: each new token is fed on every cp rank (one token, replicated). In every layer
  each rank attends the new query to the keys it holds — its prompt shard, and on cp rank 0
  also the tokens generated so far (one copy of them, so that no key counts twice) — giving a
  partial output and its log-sum-exp; the parts are all-gathered over the cp group (a few KiB)
  and merged through their lse in float32 (`lctrain_kernels.combine.merge`), which is exactly
  attention over all keys. Every rank then holds the same hidden state and the same logits;
  cp rank 0's greedy choice is broadcast so the ranks cannot drift apart.

The model is built with the attention function registered here (``lctrain_eval``): without a
``lctrain_kv`` keyword in the call it IS the "lctrain" attention (`lctrain.model.attention`),
so the same model serves perplexity runs unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lctrain.model.attention import lctrain_attention

ATTENTION_NAME = "lctrain_eval"
"""The attention function (``attn_implementation``) of models that `lctrain eval` builds."""


class KVShards:
    """The keys and values one rank keeps for decoding, per attention module.

    Args:
        group: the cp process group (None: one rank holds the whole prompt).

    Attributes:
        prompt: module -> (k, v), (B, Hkv, S_local, D): this rank's shard of the prompt.
        tail: module -> (k, v), (B, Hkv, t, D): the generated tokens (kept by every rank,
            attended to on cp rank 0 only).
        decoding: False while the prompt runs (keys are recorded), True afterwards.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.owns_tail = group is None or dist.get_rank(group) == 0
        self.prompt: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tail: dict[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.decoding = False

    def record(self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep this rank's prompt keys and values of ``module``."""
        self.prompt[module] = (key.detach(), value.detach())

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Attention of a new token's query over every key of the sequence so far, computed in
        the dtype the prompt's keys were kept in (the prefill's compute dtype).

        Args:
            module: the attention module (which layer's keys to use).
            query: (B, Hq, 1, D) the new token's query (RoPE at its global position).
            key, value: (B, Hkv, 1, D) the new token's key and value.
            scale: softmax scale (None: 1 / sqrt(D)).

        Returns:
            (B, 1, Hq, D) the attention output, identical on every rank of the group.
        """
        from lctrain_kernels.blocks import block_forward
        from lctrain_kernels.masks import MaskSpec

        keys, values = self.prompt[module]  # (B, Hkv, S_local, D)
        query, key, value = query.to(keys.dtype), key.to(keys.dtype), value.to(keys.dtype)
        old = self.tail.get(module)
        tail = (key, value) if old is None else (torch.cat([old[0], key], dim=2),
                                                 torch.cat([old[1], value], dim=2))
        self.tail[module] = tail
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
    """Partial attentions of the same query over disjoint keys, combined through their lse in
    float32 (`lctrain_kernels.combine.merge`; tiny tensors, plain torch ops)."""
    from lctrain_kernels.combine import merge

    out, lse = parts[0][0].float(), parts[0][1].float()
    for other, other_lse in parts[1:]:
        out, lse = merge(out, lse, other, other_lse)
    return out, lse


def eval_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   scaling: float | None = None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function of evaluated models (see the module docstring).

    Args:
        module, query, key, value, attention_mask, scaling, dropout: as
            `lctrain.model.attention.lctrain_attention`.
        **kwargs: ``cp_context`` as there; ``lctrain_kv`` (a `KVShards`) in a prefill that
            keeps its keys and values, or in a decoding step.

    Returns:
        (out (B, S_local, Hq, D), None).
    """
    kv: KVShards | None = kwargs.get("lctrain_kv")
    if kv is not None and kv.decoding:  # the prefill already checked what this layer asks for
        return kv.attend(module, query, key, value, scaling), None
    out, _ = lctrain_attention(module, query, key, value, attention_mask, scaling, dropout,
                               **kwargs)
    if kv is not None:  # kept in the dtype attention computed in (out's)
        kv.record(module, key.to(out.dtype), value.to(out.dtype))
    return out, None


def register_eval_attention() -> str:
    """Register ``lctrain_eval`` in transformers' AttentionInterface (idempotent).

    Returns:
        The name to pass as ``attn_implementation``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, eval_attention)
    return ATTENTION_NAME


def pick_token(logits: torch.Tensor, group: Any, vocab: int | None = None) -> torch.Tensor:
    """Greedy next tokens, the same on every rank of ``group``: cp rank 0's argmax.

    Args:
        logits: (B, V) float32 next-token logits (identical on every rank by construction).
        group: the cp group, or None.
        vocab: pick among the first ``vocab`` ids only (a tokenizer smaller than the model's
            embedding cannot write the others); None: all V.

    Returns:
        (B, 1) int64 token ids.
    """
    token = logits[:, :vocab].argmax(dim=-1, keepdim=True)  # (B, 1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
    return token


def generate(module: torch.nn.Module, prompt: list[int], steps: int, *, cp, accelerator,
             keep_logits: bool = False, vocab: int | None = None
             ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation of ``prompt`` by ``steps`` tokens (collective over the cp group).

    Args:
        module: the distributed `lctrain.eval.model.EvalModel`.
        prompt: the prompt's token ids; its length must suit the cp layout.
        steps: tokens to generate (≥ 1).
        cp: the run's `lctrain.parallel.context.ContextParallel`.
        accelerator: autocast.
        keep_logits: also return the logits of every step (float32 on the host).
        vocab: generate only ids below this (the tokenizer's size; see `pick_token`).

    Returns:
        (generated ids, per-step (V,) logits or an empty list).
    """
    from lctrain.data import PackedBatch

    length = len(prompt)
    ids = torch.tensor([prompt], dtype=torch.long)  # (1, L)
    batch = PackedBatch(ids, torch.full_like(ids, -100), torch.arange(length)[None], None)
    shard = cp.shard(batch)
    group = cp.mesh.cp_group
    kv = KVShards(group)
    tokens, kept = [], []
    with torch.no_grad():
        with cp.session(shard), accelerator.autocast():
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
