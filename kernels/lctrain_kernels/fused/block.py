"""A Llama-family attention block run one head group at a time, projections and RoPE included.

An attention module keeps q, k, v of every head and gets full-size dq, dk, dv back, and the norm
before it keeps its output: at long context among a layer's largest tensors. Here the op
``lctrain::attention_block`` (forward only) projects, rotates and attends one head group after the
other and keeps only (out, lse), which checkpointing keeps, so a recompute runs neither attention
nor projections. ``_Block`` (autograd) is the output projection; its backward runs each group again
(projections, RoPE, the attention backward) into the weight gradients and the normalised input's
gradient, then the norm's backward. Values are the module's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lctrain_kernels.combine import lse_dtype
from lctrain_kernels.distributed.executor import head_slices
from lctrain_kernels.distributed.op import backward_group, forward_group, op_options
from lctrain_kernels.fused.rope import rotate_tokens


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
    """RoPE of token-major q, k (B, S, H, D), rounded once; ``backward``: the transpose."""
    if fused:
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


@torch.library.custom_op("lctrain::attention_block", mutates_args=())
def attention_block_op(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                       bq: Optional[torch.Tensor], bk: Optional[torch.Tensor],
                       bv: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                       head_dim: int, group_name: str, causal: bool, doc_bounds: list[int],
                       softmax_scale: float, schedule: str, backend: str, overlap: bool,
                       head_groups: int, fused_rope: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, S, Hq, D), lse (B, Hq, S)) of x (B, S, hidden), one head group at a time."""
    d = head_dim
    hq, hkv = wq.shape[0] // d, wk.shape[0] // d
    out = lse = None
    for heads in head_slices(head_groups, hq, hkv):
        q, k, v = _project(x, (wq, wk, wv), (bq, bk, bv), heads, d)
        q, k = _rope(q, k, cos, sin, fused_rope)
        o, l = forward_group(q, k, v.contiguous(), group_name, causal, doc_bounds, softmax_scale,
                             schedule, backend, overlap)
        if out is None:
            out = o.new_empty((*x.shape[:2], hq, d))
            lse = l.new_empty((x.shape[0], hq, x.shape[1]))
        out[:, :, heads[0]] = o
        lse[:, heads[0]] = l
    return out, lse


@attention_block_op.register_fake
def _(x, wq, wk, wv, bq, bk, bv, cos, sin, head_dim, group_name, causal, doc_bounds,
      softmax_scale, schedule, backend, overlap, head_groups, fused_rope):
    b, s, hq = x.shape[0], x.shape[1], wq.shape[0] // head_dim
    return (x.new_empty((b, s, hq, head_dim)), x.new_empty((b, hq, s), dtype=lse_dtype(x.dtype)))


@dataclass(frozen=True)
class _Spec:
    """What ``_Block`` needs beside tensors (the norm is None when x is normalised already)."""

    norm: nn.Module | None
    dtype: torch.dtype
    autocast: tuple
    head_dim: int
    options: tuple
    fused_rope: bool


class _Block(torch.autograd.Function):
    """y = out · W_oᵀ (+ b_o); its backward is the whole block's (module docstring)."""

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
        dxn, dw, db = _attention_backward(spec, normed.detach(), dy, out, lse, cos, sin,
                                          (wq, wk, wv), (bq, bk, bv), wo, need_xn, need_w, need_b)
        dx, d_norm = None, [None] * n_norm
        if need_xn:
            wrt = [xd, *norm_params]
            got = torch.autograd.grad(normed, wrt, dxn.view_as(normed), allow_unused=True)
            dx = got[0] if ctx.needs_input_grad[0] else None
            d_norm = [g if n else None for g, n in zip(got[1:], need[:n_norm])]
        return (dx, None, None, None, None, None, None, *d_norm, *dw, dwo, *db, dbo)


def _attention_backward(spec, x, dy, out, lse, cos, sin, weights, biases, wo, need_x, need_w,
                        need_b):
    """Gradients of the normalised input x, W_q, W_k, W_v and their biases, group by group."""
    d, fused = spec.head_dim, spec.fused_rope
    rows = x.reshape(-1, x.shape[-1])  # (N, hidden)
    dx = torch.zeros_like(rows) if need_x else None
    dw = [torch.empty_like(w) if n else None for w, n in zip(weights, need_w)]
    db = [torch.empty_like(b) if b is not None and n else None for b, n in zip(biases, need_b)]
    hq, hkv = weights[0].shape[0] // d, weights[1].shape[0] // d
    for heads in head_slices(spec.options[7], hq, hkv):
        qs = heads[0]
        cols = slice(qs.start * d, qs.stop * d)
        do = dy.mm(wo[:, cols]).view(*out.shape[:2], -1, d)  # this group's d(out) (B, S, h, D)
        q, k, v = _project(x, weights, biases, heads, d)
        q, k = _rope(q, k, cos, sin, fused)
        dq, dk, dv = backward_group(do, q, k, v.contiguous(), out[:, :, qs].contiguous(),
                                    lse[:, qs].contiguous(), None, *spec.options[:7])
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


def attention_block(x: torch.Tensor, weights, biases, cos: torch.Tensor, sin: torch.Tensor,
                    head_dim: int, *, norm: nn.Module | None = None,
                    softmax_scale: float | None = None, group=None, cu_seqlens=None,
                    schedule: str = "distflash", backend="auto", head_groups: int = 1,
                    fused_rope: bool = False) -> torch.Tensor:
    """``o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))`` with ``n = norm(x)``,
    causal, one head group at a time; differentiable in x, the weights, the biases and the
    norm's parameters.

    Args:
        x: (B, S, hidden) the block's input (the layer's input when ``norm`` is given).
        weights: (W_q, W_k, W_v, W_o) ``nn.Linear`` weights, cast as autocast casts them.
        biases: their biases, or None each.
        cos, sin: (B, S, D) RoPE tables of the global positions; head_dim: D.
        norm: the norm before the block, run inside it; None: x is normalised already.
        softmax_scale, group, cu_seqlens, schedule, backend, head_groups: as
            :func:`lctrain_kernels.dist_attention`, whose errors it raises.
        fused_rope: rotate with the Triton kernel (CUDA, a power-of-two half head).

    Returns:
        (B, S, hidden) in the compute dtype.
    """
    b, s, _ = x.shape
    d, hq, hkv = head_dim, weights[0].shape[0] // head_dim, weights[1].shape[0] // head_dim
    options = op_options(torch.empty((b, s, hq, d), device="meta"),
                         torch.empty((b, s, hkv, d), device="meta"), group, True, cu_seqlens,
                         softmax_scale, schedule, backend, True, head_groups)
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731 - autocast's casts
    weights, biases = [cast(w) for w in weights], [cast(t) for t in biases]
    half = d // 2  # the RoPE kernel takes a power-of-two half head
    fused = (fused_rope and x.is_cuda and cos.shape[0] == b and d % 2 == 0
             and half & (half - 1) == 0)
    with torch.no_grad():  # the block's backward runs the norm again from its input
        normed = cast(x if norm is None else norm(x))
    with torch.autocast(device, enabled=False):
        out, lse = torch.ops.lctrain.attention_block(  # (out, lse): what remat keeps
            normed.detach(), *[w.detach() for w in weights[:3]],
            *[None if t is None else t.detach() for t in biases[:3]], cos, sin, d, *options,
            fused)
    del normed
    autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    spec = _Spec(norm, dtype, autocast, d, options, fused)
    norm_params = [] if norm is None else [p for p in norm.parameters() if p.requires_grad]
    with torch.autocast(device, enabled=False):
        return _Block.apply(x, out, lse, cos, sin, spec, len(norm_params), *norm_params,
                            *weights, *biases)
