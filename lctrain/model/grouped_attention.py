"""Attention blocks run one head group at a time, projections included.

Head groups (``parallel.head_groups``, lctrain_kernels' ``head_groups``) bound the attention
kernels' own buffers. transformers' attention module still projects q, k and v for every head at
once, keeps them for its backward, and gets full-size dq, dk and dv back from the attention: at
long context those are among the largest tensors of a layer's backward. `GroupedAttention` runs
the module's projections, RoPE and attention one head group after the other, as one operator,
``torch.ops.lctrain.attention_block``:

- forward: for each group, its rows of W_q, W_k and W_v (and biases) project the input, RoPE
  rotates q and k, and the attention (local or distributed, any backend) writes that group's
  heads of the output and the lse; the group's q, k and v are then dropped. The operator keeps
  the input, the output and the lse for its backward; the output projection runs after it, as
  in transformers.
- backward: for each group, the projections and RoPE run again (cheap beside the attention at
  the lengths where head groups are used), the attention backward gives the group's dq, dk and
  dv, and they go at once into the weight gradients (the group's rows) and into the input's
  gradient, which one matrix product per group adds to in place.

Values: the projections, RoPE (transformers' Llama formula in float32, rounded once, as the
fused kernel of `lctrain.model.rope` computes it) and the attention are those of the module; the
input's gradient is rounded once per group instead of once per projection. ``remat`` keeps the
operator's (out, lse) like the attention op's (`lctrain.parallel.checkpointing`), so the
recompute of a checkpointed layer runs neither the attention nor the projections in it.

    apply_grouped_attention(model, head_groups=8)   # after LoRA, before checkpointing and FSDP2

It applies to the Llama-family modules of :data:`GROUPED_TYPES` whose q/k/v/o projections are
plain ``nn.Linear`` (not LoRA-wrapped: adapters leave the module as it is), when the model
runs lctrain's attention. A call with a KV cache (generation) runs the module as it is.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from lctrain.memory.arch import GROUPED_TYPES
from lctrain.model.attention import ATTENTION_NAME, global_len
from lctrain.model.features import check_attention_call
from lctrain.model.structure import decoder_layers, unwrap_layer

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def supported(module: nn.Module, model_type: str) -> bool:
    """Whether ``module`` (an attention module of a ``model_type`` model) can run grouped."""
    config = getattr(module, "config", None)
    return (model_type in GROUPED_TYPES
            and getattr(config, "_attn_implementation", None) == ATTENTION_NAME
            and all(type(getattr(module, name, None)) is nn.Linear for name in _PROJECTIONS)
            and isinstance(getattr(module, "head_dim", None), int))


def apply_grouped_attention(model: nn.Module, head_groups: int, fused_rope: bool = False) -> int:
    """Run every supported attention module of ``model`` in ``head_groups`` groups (in place).

    Calling it again replaces the group count; fewer than 2 groups unwraps. Call it after LoRA
    and before checkpointing and FSDP2.

    Args:
        model: a transformers causal LM built with lctrain's attention.
        head_groups: groups of heads (a divisor of the key/value heads); < 2: off.
        fused_rope: rotate with the Triton kernel of `lctrain.model.rope` (CUDA tensors).

    Returns:
        The number of attention modules wrapped.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    wrapped = 0
    for layer in decoder_layers(model):
        layer = unwrap_layer(layer)
        attn = getattr(layer, "self_attn", None)
        if not isinstance(attn, nn.Module):
            continue
        inner = attn._checkpoint_wrapped_module if isinstance(attn, GroupedAttention) else attn
        if head_groups >= 2 and supported(inner, model_type):
            layer.self_attn = GroupedAttention(inner, head_groups, fused_rope)
            wrapped += 1
        else:
            layer.self_attn = inner
    return wrapped


class GroupedAttention(ActivationWrapper):
    """A Llama-family attention module run one head group at a time (module docstring).

    Parameter names, ``state_dict()`` and distributed checkpoints read as without it.
    """

    def __init__(self, module: nn.Module, head_groups: int, fused_rope: bool = False) -> None:
        super().__init__(module)
        kv = module.config.num_key_value_heads
        if head_groups < 1 or kv % head_groups:
            raise ValueError(f"head_groups must be a positive divisor of the {kv} key/value "
                             f"heads, got {head_groups}")
        self.head_groups, self.fused_rope = int(head_groups), bool(fused_rope)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                **kwargs):
        attn = self._checkpoint_wrapped_module
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None or position_embeddings is None:
            return attn(hidden_states, position_embeddings=position_embeddings,
                        attention_mask=attention_mask, **kwargs)
        config = attn.config
        b, s, _ = hidden_states.shape
        d, hq, hkv = attn.head_dim, config.num_attention_heads, config.num_key_value_heads
        q_shape = torch.empty((b, hq, s, d), device="meta")
        kv_shape = torch.empty((b, hkv, s, d), device="meta")
        ctx = kwargs.get("cp_context")
        dropout = attn.attention_dropout if attn.training else 0.0
        check_attention_call(attn, q_shape, kv_shape, attention_mask, dropout, kwargs,
                             global_len(s, ctx))
        options = _options(q_shape.transpose(1, 2), kv_shape.transpose(1, 2), ctx, attn.scaling,
                           self.head_groups)
        device = hidden_states.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else hidden_states.dtype)
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731 - autocast's casts
        weights = [cast(getattr(attn, n).weight) for n in _PROJECTIONS[:3]]
        biases = [cast(getattr(attn, n).bias) for n in _PROJECTIONS[:3]]
        cos, sin = position_embeddings
        half = d // 2  # the RoPE kernel takes a power-of-two half head
        fused = (self.fused_rope and hidden_states.is_cuda and cos.shape[0] == b
                 and d % 2 == 0 and half & (half - 1) == 0)
        with torch.autocast(device, enabled=False):
            out, _ = torch.ops.lctrain.attention_block(
                cast(hidden_states), *weights, *biases, cos, sin, d, *options, fused)
        return attn.o_proj(out.view(b, s, hq * d)), None

    def extra_repr(self) -> str:
        return f"head_groups={self.head_groups}"


def _options(q, k, ctx, scale: float, head_groups: int) -> tuple:
    """The attention operator's plain arguments for this call (`lctrain_kernels.api`)."""
    from lctrain_kernels.api import op_options

    if ctx is None:
        return op_options(q, k, None, True, None, scale, "distflash", "auto", True, head_groups)
    return op_options(q, k, ctx.group, True, ctx.cu_seqlens, scale, ctx.schedule, ctx.backend,
                      True, head_groups)


def _rows(w: torch.Tensor, b: torch.Tensor | None, heads: slice, d: int):
    rows = slice(heads.start * d, heads.stop * d)
    return w[rows], None if b is None else b[rows]


def _project(x, weights, biases, heads, d):
    """The group's q, k, v (B, S, h, D) from x (B, S, hidden); ``heads``: its (q, kv) slices."""
    got = []
    for w, b, part in zip(weights, biases, (heads[0], heads[1], heads[1])):
        w, b = _rows(w, b, part, d)
        got.append(nn.functional.linear(x, w, b).unflatten(-1, (-1, d)))
    return got


def _rope(q, k, cos, sin, fused: bool, backward: bool = False):
    """RoPE of token-major q, k (B, S, H, D): transformers' Llama formula in float32 (float64
    for float64 inputs), rounded once; ``backward``: the rotation's transpose."""
    if fused:
        from lctrain.model.rope import rotate_tokens

        return rotate_tokens(q.contiguous(), k.contiguous(), cos, sin, backward)
    return tuple(_rotate(x, cos, sin, backward) for x in (q, k))


def _rotate(x, cos, sin, backward: bool):
    wide = torch.promote_types(x.dtype, torch.float32)
    c, s = cos.to(wide).unsqueeze(2), sin.to(wide).unsqueeze(2)  # (B, S, 1, D)
    xf = x.to(wide)
    if backward:  # dx = dy·cos + R^T(dy·sin), R^T(y1, y2) = (y2, −y1)
        y1, y2 = (xf * s).chunk(2, dim=-1)
        turned = torch.cat((y2, -y1), dim=-1)
    else:  # y = x·cos + R(x)·sin, R(x1, x2) = (−x2, x1)
        x1, x2 = xf.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1) * s
    return (xf * c + turned).to(x.dtype).contiguous()


def _heads(groups: int, hq: int, hkv: int):
    from lctrain_kernels.distributed.executor import head_slices

    return head_slices(groups, hq, hkv)


@torch.library.custom_op("lctrain::attention_block", mutates_args=())
def attention_block_op(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                       bq: Optional[torch.Tensor], bk: Optional[torch.Tensor],
                       bv: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                       head_dim: int, group_name: str, causal: bool, doc_bounds: list[int],
                       softmax_scale: float, schedule: str, backend: str, overlap: bool,
                       head_groups: int, fused_rope: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, S, Hq, D), lse (B, Hq, S)) of x (B, S, hidden) through the projections, RoPE and
    the attention, one head group at a time."""
    from lctrain_kernels.distributed.op import forward_group

    d = head_dim
    hq, hkv = wq.shape[0] // d, wk.shape[0] // d
    run = functools.partial(forward_group, group_name=group_name, causal=causal,
                            doc_bounds=doc_bounds, softmax_scale=softmax_scale, schedule=schedule,
                            backend=backend, overlap=overlap)
    out = lse = None
    for heads in _heads(head_groups, hq, hkv):
        q, k, v = _project(x, (wq, wk, wv), (bq, bk, bv), heads, d)
        q, k = _rope(q, k, cos, sin, fused_rope)
        o, l = run(q, k, v.contiguous())
        if out is None:
            out = o.new_empty((*x.shape[:2], hq, d))
            lse = l.new_empty((x.shape[0], hq, x.shape[1]))
        out[:, :, heads[0]] = o
        lse[:, heads[0]] = l
    return out, lse


@attention_block_op.register_fake
def _(x, wq, wk, wv, bq, bk, bv, cos, sin, head_dim, group_name, causal, doc_bounds,
      softmax_scale, schedule, backend, overlap, head_groups, fused_rope):
    from lctrain_kernels.distributed.accumulate import lse_dtype

    b, s, hq = x.shape[0], x.shape[1], wq.shape[0] // head_dim
    return (x.new_empty((b, s, hq, head_dim)),
            x.new_empty((b, hq, s), dtype=lse_dtype(x.dtype)))


_TENSORS = 9  # x, wq, wk, wv, bq, bk, bv, cos, sin


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_TENSORS], *output)
    ctx.options = inputs[_TENSORS:]
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    """Gradients of x, the weights and the biases, one head group at a time."""
    from lctrain_kernels.distributed.op import backward_group

    x, wq, wk, wv, bq, bk, bv, cos, sin, out, lse = ctx.saved_tensors
    d, *attention, groups, fused = ctx.options
    need = ctx.needs_input_grad
    run = functools.partial(backward_group, **dict(zip(
        ("group_name", "causal", "doc_bounds", "softmax_scale", "schedule", "backend",
         "overlap"), attention)))
    do = torch.zeros_like(out) if dout is None else dout.contiguous()
    rows = x.reshape(-1, x.shape[-1])  # (N, hidden)
    dx = torch.zeros_like(rows) if need[0] else None
    weights, biases = (wq, wk, wv), (bq, bk, bv)
    dw = [torch.empty_like(w) if need[1 + i] else None for i, w in enumerate(weights)]
    db = [torch.empty_like(b) if b is not None and need[4 + i] else None
          for i, b in enumerate(biases)]
    hq, hkv = wq.shape[0] // d, wk.shape[0] // d
    for heads in _heads(groups, hq, hkv):
        qs = heads[0]
        q, k, v = _project(x, weights, biases, heads, d)
        q, k = _rope(q, k, cos, sin, fused)
        g_dlse = None if dlse is None else dlse[:, qs].to(lse.dtype).contiguous()
        dq, dk, dv = run(do[:, :, qs].contiguous(), q, k, v.contiguous(),
                         out[:, :, qs].contiguous(), lse[:, qs].contiguous(), g_dlse)
        dq, dk = _rope(dq, dk, cos, sin, fused, backward=True)
        grads = [t.reshape(rows.shape[0], -1) for t in (dq, dk, dv)]  # (N, h·D) each
        parts = (qs, heads[1], heads[1])
        for i, (g, part) in enumerate(zip(grads, parts)):
            r = slice(part.start * d, part.stop * d)
            if dw[i] is not None:
                torch.mm(g.t(), rows, out=dw[i][r])
            if db[i] is not None:
                db[i][r] = g.sum(0)
        if dx is not None:  # one product per group: [dq dk dv] · [W_q; W_k; W_v] of its rows
            w_rows = torch.cat([_rows(w, None, p, d)[0] for w, p in zip(weights, parts)])
            dx.addmm_(torch.cat(grads, dim=1), w_rows)
    return (None if dx is None else dx.view_as(x), *dw, *db, None, None,
            *([None] * len(ctx.options)))


attention_block_op.register_autograd(_backward, setup_context=_setup_context)
