"""Token cross-entropy through the output head, never holding more than one chunk of logits.

The logits are a long-context step's largest tensor. :func:`chunked_cross_entropy` walks the tokens
a chunk at a time: the chunk's logits ``h @ W.T``, its summed loss ``logsumexp(z) - z[label]`` and,
in the same buffer, ``dloss/dz = softmax(z) - onehot(label)`` (zero on ignored rows), which gives
the chunk's share of the gradients of the hidden states (``dz @ W``) and of the head (``dz.T @ h``,
in float32); the backward only scales them. No host sync. The CPU's loss, and the GPU's without
fused kernels; with them, Liger-Kernel's fused linear cross-entropy runs (`lctrain.train.loop`)."""
from __future__ import annotations

import torch

IGNORE_INDEX = -100


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int) -> torch.Tensor:
    """``F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100, reduction="sum")``
    in value and gradients, 0-d float32, holding the logits of at most ``chunk_tokens`` tokens at
    once: hidden (..., H), weight (V, H) in its dtype, labels (...) already shifted. ValueError
    for shapes or dtypes that do not match."""
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
    return _ChunkedCrossEntropy.apply(hidden, weight, labels, int(chunk_tokens))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens):
        h2 = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        y = labels.reshape(-1).long()  # (N,)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h2) if need_h else None  # (N, H), hidden's dtype
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                  if need_w else None)  # (V, H) fp32 accumulator
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, h2.shape[0], chunk_tokens):
            stop = min(start + chunk_tokens, h2.shape[0])
            loss += _chunk(h2[start:stop], weight, y[start:stop],
                          None if grad_h is None else grad_h[start:stop], grad_w)
        ctx.hidden_shape = hidden.shape
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)  # None where not needed
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = (grad_h * grad_output.to(grad_h.dtype)).view(ctx.hidden_shape)
        if grad_w is not None:
            grad_w = (grad_w * grad_output).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None


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

