"""One chunk's cross-entropy and its logits' gradient in one Triton kernel, in place.

With torch ops a chunk of logits (tokens × vocabulary, the widest tensor of a step for a
128K-token vocabulary) is upcast to float32, reduced for its log-sum-exp, then turned into
``softmax - onehot`` by three more float32 passes and cast back for the gradient's matrix
products: about eight passes over a float32 copy. Here one program per token reads its row
twice in its own dtype (an online max and sum, then the gradient) and writes the gradient over
the logits, rounded once; nothing float32 of the chunk's size exists.

The arithmetic is float32, as torch's: the logits as the matrix product rounded them, the
log-sum-exp accumulated in float32, ``exp(z - lse) - [label]`` rounded to the logits' dtype
(on bits for bfloat16, so Triton's interpreter rounds as the GPU does).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lctrain.model.rounding import DTYPE_KINDS, round_to

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


def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        write_grad: bool) -> torch.Tensor:
    """Per-row ``logsumexp(z) - z[label]`` of ``logits`` (C, V) as float32 (0 where the label is
    ``ignore_index``); with ``write_grad`` the logits are overwritten by the loss's gradient,
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
