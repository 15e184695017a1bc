"""Token-wise work in tiles: the forward keeps only the input, the backward recomputes one
tile at a time with the forward's random and autocast state and sums the weight gradients in
float32, so the working memory of an MLP or a norm stops growing with the tokens."""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch


def tiled_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int,
                params: Sequence[torch.Tensor], check: Callable | None = None) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn`` (each token's row of x gives one output row), over tiles of
    ``tile`` tokens of x (..., in) -> (..., out). ``params``: the trainable tensors ``fn`` reads,
    whose gradients the backward returns; ``check(y, x_tile)`` may refuse a tile's output."""
    return _TiledApply.apply(x, fn, tile, check, *params)


class _TiledApply(torch.autograd.Function):
    """y = fn(x) over tiles of x's tokens, returning the ``params``' gradients."""

    @staticmethod
    def forward(ctx, x, module, tile, check, *params):
        cuda = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None
        ctx.rng = torch.get_rng_state(), cuda  # what the tiles draw from (dropout)
        flat = x.reshape(1, -1, x.shape[-1])  # (1, N, in)
        out = None
        for a in range(0, flat.shape[1], tile):
            y = module(flat[:, a:a + tile])  # (1, t, out)
            if check is not None:
                check(y, flat[:, a:a + tile])
            if out is None:
                out = y.new_empty((*x.shape[:-1], y.shape[-1]))  # (..., out)
                rows = out.view(1, -1, y.shape[-1])
            rows[:, a:a + tile] = y
        ctx.module, ctx.tile, ctx.params = module, tile, params
        kind = x.device.type
        ctx.autocast = dict(device_type=kind, dtype=torch.get_autocast_dtype(kind),
                            enabled=torch.is_autocast_enabled(kind))
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params, tile = ctx.params, ctx.tile
        flat = x.reshape(1, -1, x.shape[-1]).detach()  # (1, N, in)
        grads = grad_out.reshape(1, -1, grad_out.shape[-1])  # (1, N, out)
        need_x = ctx.needs_input_grad[0]
        grad_x = torch.empty_like(flat) if need_x else None  # (1, N, in)
        acc: list[torch.Tensor | None] = [None] * len(params)
        with _replayed(ctx.rng, x.device), torch.enable_grad(), torch.autocast(**ctx.autocast):
            for a in range(0, flat.shape[1], tile):
                xt = flat[:, a:a + tile].detach().requires_grad_(need_x)  # (1, t, in)
                y = ctx.module(xt)
                wrt = ([xt] if need_x else []) + list(params)
                got = torch.autograd.grad(y, wrt, grads[:, a:a + tile], allow_unused=True)
                if need_x:
                    grad_x[:, a:a + tile] = got[0]
                    got = got[1:]
                for i, g in enumerate(got):  # summed in float32 (float64 stays float64)
                    if g is not None:
                        acc[i] = (g.to(torch.promote_types(g.dtype, torch.float32), copy=True)
                                  if acc[i] is None else acc[i].add_(g))
        param_grads = [None if g is None else g.to(p.dtype) for g, p in zip(acc, params)]
        return (None if grad_x is None else grad_x.view_as(x), None, None, None, *param_grads)


@contextlib.contextmanager
def _replayed(state: tuple, device: torch.device):
    """Run with the random state the forward started from (the CPU's and, on a GPU, that
    device's), restoring the current one after."""
    cpu, cuda = state
    devices = [device] if cuda is not None else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
