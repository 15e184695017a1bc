"""Token cross-entropy through the output head without materialising all logits.

At long context the logits are the largest tensor of a step: 256K tokens × a 128K vocabulary in
fp32 is 128 GiB. `chunked_cross_entropy` never holds more than ``chunk_tokens`` rows of them:

- the forward walks the tokens chunk by chunk; for each chunk it computes the logits
  ``h @ W.T`` (in the inputs' dtype, as ``F.linear`` would), upcasts them to fp32, adds the
  chunk's loss ``logsumexp(z) - z[label]`` to a running fp32 sum, and immediately turns the same
  buffer into ``dloss/dz = softmax(z) - onehot(label)`` (zero on ignored rows) to produce the
  chunk's gradients with respect to the hidden states (``dz @ W``) and the head weight
  (``dz.T @ h``, accumulated over chunks in fp32);
- the backward only multiplies those stored gradients by the incoming scalar ``grad_output``.

On GPUs the chunk's loss and ``dloss/dz`` come from one Triton kernel
(`lctrain.train.loss_kernel`) that reads the logits in their own dtype and writes the gradient
over them, with no float32 copy, and the head weight's gradient is accumulated by the matrix
product itself in float32 (``addmm`` with a float32 output). The torch ops above are the CPU's
path and the reference the kernel is tested against.

So the working set is one chunk of logits, ``chunk_tokens × vocab × (4 + itemsize)`` bytes
(on GPUs ``chunk_tokens × vocab × itemsize``), plus
the gradients (``hidden``-sized, and an fp32 ``weight``-sized accumulator): see
`lctrain.memory` for how this enters the per-GPU estimate. No host synchronisation happens: the
chunk loop runs over host integers only and ignored labels are masked, not skipped.

Labels use -100 for ignored positions (the transformers convention); they must already be
shifted (``labels[t]`` is the token that follows ``input[t]``).
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int, kernel: bool | None = None) -> torch.Tensor:
    """Summed token cross-entropy of ``hidden @ weight.T`` against ``labels``.

    Equal to ``F.cross_entropy((hidden @ weight.T).float().flatten(0, -2), labels.flatten(),
    ignore_index=-100, reduction="sum")`` in value and gradients, without all logits at once.

    Args:
        hidden: (..., H) final hidden states (after the final norm), any float dtype.
        weight: (V, H) output-head weight, same dtype as ``hidden``.
        labels: (...) int64 target ids, same leading shape as ``hidden``; -100 = ignore.
        chunk_tokens: how many tokens' logits to hold at once (> 0).
        kernel: each chunk's loss and gradient through the Triton kernel (True; on a CPU it
            needs ``TRITON_INTERPRET=1``) or torch ops (False); None: the kernel on CUDA.

    Returns:
        0-d float32 tensor: the SUM of the per-token losses over labels != -100 (0 if none);
        the caller divides by the (global) number of label tokens.

    Raises:
        ValueError: shapes or dtypes that do not match, or ``chunk_tokens`` ≤ 0.
    """
    _check_inputs(hidden, weight, labels, chunk_tokens)
    if kernel is None:
        kernel = hidden.is_cuda
    return _ChunkedCrossEntropy.apply(hidden, weight, labels, int(chunk_tokens), kernel)


def _check_inputs(hidden, weight, labels, chunk_tokens) -> None:
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


def _chunk(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
           grad_h_out: torch.Tensor | None, grad_w_acc: torch.Tensor | None) -> torch.Tensor:
    """Loss of one chunk; writes d(loss)/dh into ``grad_h_out`` and adds d(loss)/dW to
    ``grad_w_acc`` (both optional)."""
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


def _kernel_chunk(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
                  grad_h_out: torch.Tensor | None, grad_w_acc: torch.Tensor | None
                  ) -> torch.Tensor:
    """`_chunk` through `lctrain.train.loss_kernel`: the logits in their own dtype become the
    gradient in place; the weight's gradient is summed into the float32 accumulator by the
    product itself where the device has that (CUDA), else through the compute dtype as
    `_chunk` does."""
    from lctrain.train.loss_kernel import cross_entropy_rows_

    logits = h @ weight.T  # (C, V), the inputs' dtype
    need_grad = grad_h_out is not None or grad_w_acc is not None
    loss = cross_entropy_rows_(logits, y, IGNORE_INDEX, write_grad=need_grad).sum()
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
