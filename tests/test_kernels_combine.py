"""Combining partial results: the Triton kernels (interpreter on CPU; CUDA when there is one)
and the dispatching functions, against float64 sums and float64 attention merges."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lctrain_kernels.combine import merge_many_into, sum_into
from lctrain_kernels.triton.merge import MAX_INPUTS, merge_fused, sum_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _parts(k, b, s, h, d, dtype):
    """k partial (out, lse) of the same rows; some rows saw nothing in some parts, row 2 in none."""
    outs = [torch.randn(b, s, h, d, device=DEVICE).to(dtype) for _ in range(k)]
    lses = [torch.randn(b, h, s, device=DEVICE) * 3 for _ in range(k)]
    for i, (o, l) in enumerate(zip(outs, lses)):
        row = i % 2  # part i saw nothing in row i % 2
        l[:, :, row], o[:, row] = float("-inf"), 0
        l[:, :, 2], o[:, 2] = float("-inf"), 0
    return outs, lses


def _want_merge(outs, lses):
    lse = torch.logsumexp(torch.stack([l.double().cpu() for l in lses]), 0)  # (B, H, S)
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    out = sum(o.double().cpu() * (l.double().cpu() - safe).exp().transpose(1, 2)[..., None]
              for o, l in zip(outs, lses))
    return out, lse


def _strided(x):
    return x.transpose(1, 2).contiguous().transpose(1, 2)  # BHSD storage seen as BSHD


@pytest.mark.parametrize("k", range(1, MAX_INPUTS + 1))
@pytest.mark.parametrize("b,s,h,d,dtype", [(1, 7, 3, 80, torch.bfloat16), (2, 5, 2, 16, torch.float32)])
def test_fused_kernels_equal_float64(k, b, s, h, d, dtype):
    outs, lses = _parts(k, b, s, h, d, dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    big = torch.full((b, s + 4, h, d), 7.0, device=DEVICE, dtype=dtype)  # a slice of a larger buffer
    big_lse = torch.full((b, h, s + 4), 7.0, device=DEVICE)
    merge_fused(big[:, 2:2 + s], big_lse[:, :, 2:2 + s], [(_strided(o), l) for o, l in zip(outs, lses)])
    want, want_lse = _want_merge(outs, lses)
    torch.testing.assert_close(big[:, 2:2 + s].double().cpu(), want, **tol)
    torch.testing.assert_close(big_lse[:, :, 2:2 + s].double().cpu(), want_lse, rtol=1e-5, atol=1e-5)
    assert (big[:, :2] == 7).all() and (big_lse[:, :, s + 2:] == 7).all()  # nothing else written
    assert torch.isneginf(big_lse[:, :, 4]).all() and (big[:, 4] == 0).all()  # row 2 saw nothing
    total = torch.full((b, s, h, d), float("nan"), device=DEVICE, dtype=dtype)
    sum_fused(total, [_strided(o) for o in outs])
    torch.testing.assert_close(total.double().cpu(), sum(o.double().cpu() for o in outs), **tol)


def test_fused_kernels_fold_in_place_into_a_float32_accumulator():
    outs, lses = _parts(3, 1, 6, 2, 32, torch.bfloat16)
    acc, acc_lse = outs[0].float(), lses[0].clone()
    merge_fused(acc, acc_lse, [(acc, acc_lse), (outs[1], lses[1]), (outs[2], lses[2])])
    want, want_lse = _want_merge(outs, lses)
    torch.testing.assert_close(acc.double().cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc_lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)
    grad = outs[0].float()
    sum_fused(grad, [grad, outs[1], outs[2]])
    torch.testing.assert_close(grad.double().cpu(), sum(o.double().cpu() for o in outs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_combine_functions_take_any_number_of_parts(dtype):
    outs, lses = _parts(MAX_INPUTS + 3, 2, 5, 3, 8, dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    dst = torch.full_like(outs[0], float("nan"))
    dst_lse = torch.full_like(lses[0], float("nan"))
    merge_many_into(dst, dst_lse, list(zip(outs, lses)))
    want, want_lse = _want_merge(outs, lses)
    torch.testing.assert_close(dst.double().cpu(), want, **tol)
    torch.testing.assert_close(dst_lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)
    sum_into(dst, outs)
    torch.testing.assert_close(dst.double().cpu(), sum(o.double().cpu() for o in outs), **tol)
    with pytest.raises(ValueError, match="at least one"):
        sum_into(dst, [])
    with pytest.raises(ValueError, match="same rows"):
        sum_into(dst, [outs[0][:, 1:]])


def test_merge_many_into_folds_into_one_of_its_parts():
    outs, lses = _parts(2, 1, 5, 2, 16, torch.float16)
    acc, acc_lse = outs[0].float(), lses[0].clone()  # a float32 accumulator, updated in place
    merge_many_into(acc, acc_lse, [(acc, acc_lse), (outs[1], lses[1])])
    want, want_lse = _want_merge(outs, lses)
    torch.testing.assert_close(acc.double().cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc_lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merges_hold_where_exp_leaves_float32s_range(dtype):
    """Rows whose lse lies at ±80..±200 (exp of a float32 overflows above 88.7 and is 0 below
    -103.9), the pieces of a row within a few units of each other as in attention: the kernel
    and the functions merge them as float64 math does (the larger lse is subtracted first)."""
    outs, lses = _parts(MAX_INPUTS, 2, 6, 3, 16, dtype)
    b, h, s = lses[0].shape
    sign = torch.randint(0, 2, (b, h, s), device=DEVICE) * 2 - 1
    shift = sign * (80 + 120 * torch.rand(b, h, s, device=DEVICE))  # (B, H, S) ±80..±200
    lses = [lse + shift for lse in lses]
    want, want_lse = _want_merge(outs, lses)
    # a float32 lse near 200 is rounded to 1.5e-5: its weights carry that relative error
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=5e-5, atol=5e-5)
    for merged in ("kernel", "functions"):
        dst = torch.full_like(outs[0], float("nan"))
        dst_lse = torch.full_like(lses[0], float("nan"))
        merge = merge_fused if merged == "kernel" else merge_many_into
        merge(dst, dst_lse, list(zip(outs, lses)))
        said = lambda text: f"{merged}: {text}"  # noqa: E731
        torch.testing.assert_close(dst_lse.double().cpu(), want_lse, rtol=1e-6, atol=0, msg=said)
        torch.testing.assert_close(dst.double().cpu(), want, **tol, msg=said)
        assert torch.isneginf(dst_lse[:, :, 2]).all() and (dst[:, 2] == 0).all()  # saw nothing


def test_merge_kernel_compiles_once_per_layout_of_outputs_not_per_lse_slice():
    """The lse slices' pointers and strides move with each document layout: the compiled kernel
    must not specialise on them (a new compile per row range), but keeps the outputs'."""
    code = ("from lctrain_kernels.triton.merge import merge_kernel as k; "
            "print(*(p.name for p in k.params if p.do_not_specialize_on_alignment))")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    free = set(out.split())
    lse = {"DstLse", "L0", "L1", "L2", "L3"} | {f"{t}_{a}" for t in ("dl", "l0", "l1", "l2", "l3")
                                               for a in ("b", "h")}
    assert lse <= free
    assert not free & {"Dst", "X0", "X1", "X2", "X3", "d_b", "d_s", "d_h", "x0_b", "dl_s"}
