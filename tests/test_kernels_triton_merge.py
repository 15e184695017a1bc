"""The one-kernel Triton merge (interpreter on CPU; CUDA when there is one) against the torch
ops of ``lctrain_kernels.merge.merge_into`` (themselves checked against float64 attention)."""
from __future__ import annotations

import pytest
import torch

from lctrain_kernels.merge import merge_into
from lctrain_kernels.triton.merge import merge_into_fused


def _pieces(b, s, h, d, device, dtype):
    """Accumulator (float32), a partial result in ``dtype``; some rows saw nothing."""
    acc = torch.randn(b, s, h, d, device=device)
    acc_lse = torch.randn(b, h, s, device=device) * 3
    out = torch.randn(b, s, h, d, device=device).to(dtype)
    lse = torch.randn(b, h, s, device=device) * 3
    acc_lse[:, :, 0] = float("-inf")  # the accumulator saw nothing yet here
    acc[:, 0] = 0
    lse[:, :, 1] = float("-inf")  # the new piece saw nothing here
    out[:, 1] = 0
    acc_lse[:, :, 2] = lse[:, :, 2] = float("-inf")  # neither
    acc[:, 2] = 0
    out[:, 2] = 0
    return acc, acc_lse, out, lse


@pytest.mark.parametrize("b,s,h,d,dtype", [(1, 37, 3, 80, torch.bfloat16), (2, 9, 4, 64, torch.float32),
                                           (1, 5, 2, 16, torch.float16)])
def test_fused_merge_equals_the_torch_merge(b, s, h, d, dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    acc, acc_lse, out, lse = _pieces(b, s, h, d, device, dtype)
    big_acc = torch.zeros(b, s + 6, h, d, device=device)  # a slice of a larger buffer, as in OutAcc
    big_lse = torch.zeros(b, h, s + 6, device=device)
    big_acc[:, 3:3 + s] = acc
    big_lse[:, :, 3:3 + s] = acc_lse
    out_strided = out.transpose(1, 2).contiguous().transpose(1, 2)  # BHSD storage seen as BSHD
    want_acc, want_lse = acc.cpu().clone(), acc_lse.cpu().clone()  # the torch ops, on the CPU
    merge_into(want_acc, want_lse, out.cpu(), lse.cpu())
    merge_into_fused(big_acc[:, 3:3 + s], big_lse[:, :, 3:3 + s], out_strided, lse)
    torch.testing.assert_close(big_acc[:, 3:3 + s].cpu(), want_acc.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(big_lse[:, :, 3:3 + s].cpu(), want_lse.cpu(), rtol=1e-5, atol=1e-5)
    assert not big_acc.isnan().any() and torch.isneginf(big_lse[:, :, 5]).all()
    assert (big_acc[:, :3] == 0).all() and (big_lse[:, :, s + 3:] == 0).all()  # nothing else
