"""Attention blocks run one head group at a time: the norm before them, their projections and
RoPE included.

Head groups (``parallel.head_groups``, lctrain_kernels' ``head_groups``) bound the attention
kernels' own buffers. transformers' attention module still projects q, k and v for every head at
once, keeps them for its backward, and gets full-size dq, dk and dv back from the attention; the
output projection hands the attention a full-size gradient of its output; and the norm before
the block keeps its full-size output. At long context those are among the largest tensors of a
layer's backward. `GroupedAttention` runs the layer's first norm, the module's projections, RoPE
and attention one head group after the other, in two parts:

- ``torch.ops.lctrain.attention_block`` (forward only): for each group, its rows of W_q, W_k and
  W_v (and biases) project the normalised input, RoPE rotates q and k, and the attention (local
  or distributed, any backend) writes that group's heads of the output and the lse; the group's
  q, k and v are then dropped. ``remat`` keeps its (out, lse) like the attention op's
  (`lctrain.parallel.activation_checkpoint`), so the recompute of a checkpointed layer runs neither the
  attention nor the projections in it.
- `_Block` (autograd): the output projection, keeping the block's input (the layer input, which
  the layer holds anyway: the norm is deferred to here, `lctrain.model.deferred_norm`), the
  output and the lse. Its backward takes the gradient of the block's result and, for each
  group, makes that group's share of the output's gradient (one product with W_o's columns),
  projects and rotates the group again, runs the attention backward and puts dq, dk and dv at
  once into the weight gradients (the group's rows) and into the gradient of the normalised
  input, which one matrix product per group adds to in place; last, the norm's backward.

Values: the norm is the layer's own module, the projections, RoPE (transformers' Llama formula
in float32, rounded once, as the fused kernel of `lctrain.model.rope` computes it) and the
attention are those of the module; the normalised input's gradient is rounded once per group
instead of once per projection.

    apply_grouped_attention(model, head_groups=8)   # after LoRA, before checkpointing and FSDP2

It applies to the Llama-family modules of `lctrain.model.families` (``grouped``) whose q/k/v/o projections are
plain ``nn.Linear`` (not LoRA-wrapped: adapters leave the module as it is), when the model
runs lctrain's attention. A call with a KV cache (generation) runs the norm and the module as
they are.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from lctrain.model.families import family
from lctrain.model.attention import ATTENTION_NAME, global_len
from lctrain.model.deferred_norm import DeferredNorm, bare
from lctrain.model.features import check_attention_call
from lctrain.model.structure import decoder_layers, unwrap_layer

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
    it too) in ``head_groups`` groups (in place).

    Calling it again replaces the group count; fewer than 2 groups unwraps. Call it after LoRA
    and before tiling, checkpointing and FSDP2.

    Args:
        model: a transformers causal LM built with lctrain's attention.
        head_groups: groups of heads (a divisor of the key/value heads); < 2: off.
        fused_rope: rotate with the Triton kernel of `lctrain.model.rope` (CUDA tensors).
        defer_norm: the layer's ``input_layernorm`` runs inside the block
            (`lctrain.model.deferred_norm`); False: before it, as in transformers.

    Returns:
        The number of attention modules wrapped.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    wrapped = 0
    for layer in decoder_layers(model):
        layer = unwrap_layer(layer)
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
    """A Llama-family attention module run one head group at a time (module docstring). Given
    ``norm``, the layer's norm before it runs inside too, and it takes the layer's input.

    Parameter names, ``state_dict()`` and distributed checkpoints read as without it.
    """

    def __init__(self, module: nn.Module, head_groups: int, fused_rope: bool = False,
                 norm: nn.Module | None = None) -> None:
        super().__init__(module)
        kv = module.config.num_key_value_heads
        if head_groups < 1 or kv % head_groups:
            raise ValueError(f"head_groups must be a positive divisor of the {kv} key/value "
                             f"heads, got {head_groups}")
        self.head_groups, self.fused_rope = int(head_groups), bool(fused_rope)
        self._norm = (norm,)  # not a child (a tuple): it stays registered in its layer

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                **kwargs):
        attn, norm = self._checkpoint_wrapped_module, self._norm[0]
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None or position_embeddings is None:
            x = hidden_states if norm is None else norm(hidden_states)
            return attn(x, position_embeddings=position_embeddings,
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
        weights = [cast(getattr(attn, n).weight) for n in _PROJECTIONS]
        biases = [cast(getattr(attn, n).bias) for n in _PROJECTIONS]
        cos, sin = position_embeddings
        half = d // 2  # the RoPE kernel takes a power-of-two half head
        fused = (self.fused_rope and hidden_states.is_cuda and cos.shape[0] == b
                 and d % 2 == 0 and half & (half - 1) == 0)
        with torch.no_grad():  # the block's backward runs the norm again from its input
            normed = cast(hidden_states if norm is None else norm(hidden_states))
        with torch.autocast(device, enabled=False):
            out, lse = torch.ops.lctrain.attention_block(  # (out, lse): what remat keeps
                normed.detach(), *[w.detach() for w in weights[:3]],
                *[None if x is None else x.detach() for x in biases[:3]], cos, sin, d, *options,
                fused)
        del normed
        spec = _Spec(norm, dtype, _autocast_state(hidden_states.device), d, options, fused)
        norm_params = [] if norm is None else [p for p in norm.parameters() if p.requires_grad]
        with torch.autocast(device, enabled=False):
            y = _Block.apply(hidden_states, out, lse, cos, sin, spec, len(norm_params),
                             *norm_params, *weights, *biases)
        return y, None

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


@dataclass(frozen=True)
class _Spec:
    """What `_Block` needs beside tensors: the norm module (None: the input is normalised
    already), the compute dtype and autocast state
    of the forward, the head size, the attention operator's plain arguments and RoPE's kernel."""

    norm: nn.Module | None
    dtype: torch.dtype
    autocast: tuple
    head_dim: int
    options: tuple
    fused_rope: bool


def _autocast_state(device: torch.device) -> tuple:
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


class _Block(torch.autograd.Function):
    """y = out · W_oᵀ (+ b_o) for the block of x (module docstring); its backward is the whole
    block's: the norm, the projections, RoPE, the attention and the output projection."""

    @staticmethod
    def forward(ctx, x, out, lse, cos, sin, spec, n_norm, *tensors):
        wo, bo = tensors[n_norm + 3], tensors[n_norm + 7]
        y = nn.functional.linear(out.flatten(-2), wo, bo)  # (B, S, hidden)
        ctx.spec, ctx.n_norm = spec, n_norm
        ctx.save_for_backward(x, out, lse, cos, sin, *tensors)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, out, lse, cos, sin, *tensors = ctx.saved_tensors
        spec, n_norm = ctx.spec, ctx.n_norm
        norm_params, (wq, wk, wv, wo, bq, bk, bv, bo) = tensors[:n_norm], tensors[n_norm:]
        need = ctx.needs_input_grad[7:]  # norm parameters, weights, biases
        need_w, need_b = need[n_norm:n_norm + 4], need[n_norm + 4:]
        need_xn = ctx.needs_input_grad[0] or any(need[:n_norm])
        dy = dy.reshape(-1, dy.shape[-1])  # (N, hidden)
        o_rows = out.flatten(-2).reshape(dy.shape[0], -1)  # (N, Hq·D)
        dwo = dy.t().mm(o_rows) if need_w[3] else None
        dbo = dy.sum(0) if bo is not None and need_b[3] else None
        if spec.norm is None:  # x is the normalised input
            dx, dw, db = _attention_backward(spec, x.to(spec.dtype), dy, out, lse, cos, sin,
                                             (wq, wk, wv), (bq, bk, bv), wo, need_xn, need_w,
                                             need_b)
            dx = None if dx is None else dx.view_as(x).to(x.dtype)
            return (dx, None, None, None, None, None, None, *dw, dwo, *db, dbo)
        xd = x.detach().requires_grad_(need_xn)
        with torch.enable_grad(), torch.autocast(*spec.autocast[:1], dtype=spec.autocast[2],
                                                 enabled=spec.autocast[1]):
            normed = spec.norm(xd).to(spec.dtype)
        grads = _attention_backward(spec, normed.detach(), dy, out, lse, cos, sin,
                                    (wq, wk, wv), (bq, bk, bv), wo, need_xn, need_w, need_b)
        dxn, dw, db = grads
        dx, d_norm = None, [None] * n_norm
        if need_xn:
            wrt = [xd, *norm_params]
            got = torch.autograd.grad(normed, wrt, dxn.view_as(normed), allow_unused=True)
            dx = got[0] if ctx.needs_input_grad[0] else None
            d_norm = [g if n else None for g, n in zip(got[1:], need[:n_norm])]
        return (dx, None, None, None, None, None, None, *d_norm, *dw, dwo, *db, dbo)


def _attention_backward(spec, x, dy, out, lse, cos, sin, weights, biases, wo, need_x, need_w,
                        need_b):
    """Gradients of the normalised input x, of W_q, W_k, W_v and of their biases, one head
    group at a time; each group's share of the output's gradient is dy · W_o's columns."""
    from lctrain_kernels.distributed.op import backward_group

    d, fused = spec.head_dim, spec.fused_rope
    run = functools.partial(backward_group, **dict(zip(
        ("group_name", "causal", "doc_bounds", "softmax_scale", "schedule", "backend",
         "overlap"), spec.options[:7])))
    groups = spec.options[7]
    rows = x.reshape(-1, x.shape[-1])  # (N, hidden)
    dx = torch.zeros_like(rows) if need_x else None
    dw = [torch.empty_like(w) if n else None for w, n in zip(weights, need_w)]
    db = [torch.empty_like(b) if b is not None and n else None for b, n in zip(biases, need_b)]
    hq, hkv = weights[0].shape[0] // d, weights[1].shape[0] // d
    for heads in _heads(groups, hq, hkv):
        qs = heads[0]
        cols = slice(qs.start * d, qs.stop * d)
        do = dy.mm(wo[:, cols]).view(*out.shape[:2], -1, d)  # this group's d(out) (B, S, h, D)
        q, k, v = _project(x, weights, biases, heads, d)
        q, k = _rope(q, k, cos, sin, fused)
        dq, dk, dv = run(do, q, k, v.contiguous(), out[:, :, qs].contiguous(),
                         lse[:, qs].contiguous(), None)
        del do, q, k, v
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
    return dx, dw, db
