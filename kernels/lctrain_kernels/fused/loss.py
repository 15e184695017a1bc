"""Token cross-entropy through the output head, never holding more than one chunk of logits.

The logits are a long-context step's largest tensor. :func:`chunked_cross_entropy` walks the tokens
a chunk at a time: the chunk's logits ``h @ W.T``, its summed loss ``logsumexp(z) - z[label]`` and,
in the same buffer, ``dloss/dz = softmax(z) - onehot(label)`` (zero on ignored rows), which gives
the chunk's share of the gradients of the hidden states (``dz @ W``) and of the head (``dz.T @ h``,
in float32); the backward only scales them. No host sync. On GPUs one Triton kernel per chunk
overwrites the logits with the gradient in their own dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lctrain_kernels.triton.common import DTYPE_KINDS, round_to

IGNORE_INDEX = -100
_BLOCK = 4096  # vocabulary entries per iteration of a program


@triton.jit
def _cross_entropy_rows(Z, Y, Loss, n_cols, stride, ignore_index, WRITE_GRAD: tl.constexpr,
                        KIND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride
    cols = tl.arange(0, BLOCK)
    label = tl.load(Y + row)
    valid = label != ignore_index
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        z = tl.load(base + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        new = tl.maximum(m, z)
        shift = tl.where(new > float("-inf"), new, 0.0)  # lanes past the last column stay 0
        s = s * tl.exp(m - shift) + tl.exp(z - shift)
        m = new
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))
    target = tl.where(valid, label, 0).to(tl.int64)
    z_label = tl.load(base + target).to(tl.float32)
    tl.store(Loss + row, tl.where(valid, lse - z_label, 0.0))
    if WRITE_GRAD:
        keep = tl.where(valid, 1.0, 0.0)
        for start in range(0, n_cols, BLOCK):
            at = start + cols
            live = at < n_cols
            z = tl.load(base + at, mask=live, other=0.0).to(tl.float32)
            grad = tl.exp(z - lse) - tl.where(at == target, 1.0, 0.0)
            tl.store(base + at, round_to(grad * keep, KIND), mask=live)


@torch.library.custom_op("lctrain::cross_entropy_rows_", mutates_args=("logits",))
def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        write_grad: bool) -> torch.Tensor:
    """Per-row ``logsumexp(z) - z[label]`` of ``logits`` (C, V) as float32 (0 where the label is
    ``ignore_index``); with ``write_grad`` the logits are overwritten by
    ``softmax(z) - onehot(label)`` (zero on ignored rows), in their own dtype."""
    rows, cols = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the logits' vocabulary dimension must be contiguous")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _cross_entropy_rows[(rows,)](logits, labels, loss, cols, logits.stride(0), ignore_index,
                                     WRITE_GRAD=write_grad, KIND=DTYPE_KINDS[logits.dtype],
                                     BLOCK=min(_BLOCK, triton.next_power_of_2(cols)))
    return loss


@cross_entropy_rows_.register_fake
def _(logits, labels, ignore_index, write_grad):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int, kernel: bool | None = None) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="sum")``
    in value and gradients, 0-d float32, holding the logits of at most ``chunk_tokens`` tokens at
    once: hidden (..., H), weight (V, H) in its dtype, labels (...) already shifted. ``kernel``: the
    Triton kernel (True), torch ops (False), or the kernel on CUDA (None). ValueError for shapes or
    dtypes that do not match."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not "
                         "share the hidden size (weight must be (vocab, hidden))")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the leading shape of hidden "
                         f"{tuple(hidden.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    if kernel is None:
        kernel = hidden.is_cuda
    return _ChunkedCrossEntropy.apply(hidden, weight, labels, int(chunk_tokens), kernel)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens, kernel):
        h2 = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        y = labels.reshape(-1).long()  # (N,)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h2) if need_h else None  # (N, H), hidden's dtype
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                  if need_w else None)  # (V, H) fp32 accumulator
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        chunk = _kernel_chunk if kernel else _chunk
        for start in range(0, h2.shape[0], chunk_tokens):
            stop = min(start + chunk_tokens, h2.shape[0])
            loss += chunk(h2[start:stop], weight, y[start:stop],
                          None if grad_h is None else grad_h[start:stop], grad_w)
        ctx.hidden_shape = hidden.shape
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        ctx.has = (need_h, need_w)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.has
        grad_h = saved.pop(0) if need_h else None
        grad_w = saved.pop(0) if need_w else None
        if grad_h is not None:
            grad_h = (grad_h * grad_output.to(grad_h.dtype)).view(ctx.hidden_shape)
        if grad_w is not None:
            grad_w = (grad_w * grad_output).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def _chunk(h, weight, y, grad_h_out, grad_w_acc) -> torch.Tensor:
    """Loss of one chunk in torch ops; writes dh into ``grad_h_out``, adds dW to ``grad_w_acc``."""
    valid = y != IGNORE_INDEX  # (C,)
    target = torch.where(valid, y, 0).unsqueeze(1)  # (C, 1)
    logits = (h @ weight.T).float()  # (C, V) fp32
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (C, 1)
    token_loss = lse.squeeze(1) - logits.gather(1, target).squeeze(1)  # (C,)
    loss = torch.where(valid, token_loss, 0.0).sum()
    if grad_h_out is None and grad_w_acc is None:
        return loss
    dz = logits.sub_(lse).exp_()  # (C, V): softmax, in place of the logits
    dz.scatter_add_(1, target, torch.full_like(lse, -1.0))  # softmax - onehot(label)
    dz.mul_(valid.unsqueeze(1))  # ignored rows carry no gradient
    dz_low = dz.to(h.dtype)  # (C, V) the matmul dtype (no copy for fp32)
    if grad_h_out is not None:
        torch.matmul(dz_low, weight, out=grad_h_out)  # (C, H)
    if grad_w_acc is not None:
        grad_w_acc += (dz_low.T @ h).float()  # (V, H)
    return loss


def _kernel_chunk(h, weight, y, grad_h_out, grad_w_acc) -> torch.Tensor:
    """:func:`_chunk` through the kernel (the logits become the gradient in place)."""
    logits = h @ weight.T  # (C, V), the inputs' dtype
    need_grad = grad_h_out is not None or grad_w_acc is not None
    loss = torch.ops.lctrain.cross_entropy_rows_(logits, y, IGNORE_INDEX, need_grad).sum()
    if grad_h_out is not None:
        torch.matmul(logits, weight, out=grad_h_out)  # (C, H)
    if grad_w_acc is not None:
        if h.dtype == torch.float32:
            grad_w_acc.addmm_(logits.T, h)
        elif grad_w_acc.is_cuda:  # (V, H) += dz.T @ h, accumulated and written in float32
            torch.addmm(grad_w_acc, logits.T, h, out_dtype=torch.float32, out=grad_w_acc)
        else:
            grad_w_acc += (logits.T @ h).float()
    return loss
