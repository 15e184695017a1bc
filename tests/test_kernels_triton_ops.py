"""The Triton attention behind the one attention op, and as a Backend (interpreter on CPU).

* ``attention_with_lse(..., backend="triton")`` is differentiable through ``out`` AND ``lse``
  (float64 autograd oracle): the lse gradient is folded into the kernels' delta;
* ``torch.compile(fullgraph=True)`` traces the op through its fake kernel;
* ``TritonBackend`` matches the reference backend on FULL / CAUSAL / PARTIAL blocks, with and
  without an lse gradient, and says in one sentence why it refuses a block.
"""
from __future__ import annotations

import pytest
import torch

from lctrain_kernels import attention_with_lse
from lctrain_kernels.backends.reference import ReferenceBackend
from lctrain_kernels.backends.triton import TritonBackend
from lctrain_kernels.masks import MaskSpec, Relation, classify
from test_kernels_triton import inputs, make_mask, reference, rel_err


def test_autograd_through_out_and_lse():
    q, k, v = inputs(1, 70, 70, 4, 2, 32, torch.float32)
    bounds = (0, 25, 70)
    w = torch.randn(1, 70, 4, 32, dtype=torch.float64)
    u = torch.randn(1, 4, 70, dtype=torch.float64)

    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = reference(qd, kd, vd, make_mask(70, 70, True, doc_bounds=bounds), 0.2)
    ((out * w).sum() + (lse * u).sum()).backward()

    qt, kt, vt = (x.clone().requires_grad_() for x in (q, k, v))
    out_t, lse_t = attention_with_lse(qt, kt, vt, causal=True, softmax_scale=0.2,
                                      cu_seqlens=list(bounds), backend="triton")
    ((out_t.double() * w).sum() + (lse_t.double() * u).sum()).backward()
    assert rel_err(out_t, out.detach()) < 1e-5 and rel_err(lse_t, lse.detach()) < 1e-5
    for got, ref in ((qt.grad, qd.grad), (kt.grad, kd.grad), (vt.grad, vd.grad)):
        assert rel_err(got, ref) < 1e-4


def test_torch_compile_traces_the_op():
    q, k, v = (x.requires_grad_() for x in inputs(1, 40, 40, 2, 1, 32, torch.float32))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(q, k, v):
        out, lse = attention_with_lse(q, k, v, causal=True, cu_seqlens=[0, 8, 40],
                                      backend="triton")
        return out.sum() + lse.sum()

    loss = f(q, k, v)
    loss.backward()
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, lse = reference(qd, kd, vd, make_mask(40, 40, True, doc_bounds=(0, 8, 40)), 32 ** -0.5)
    (out.sum() + lse.sum()).backward()
    assert abs(loss.item() - (out.sum() + lse.sum()).item()) < 1e-3
    assert rel_err(q.grad, qd.grad) < 1e-4 and rel_err(k.grad, kd.grad) < 1e-4


@pytest.mark.parametrize("spec, sq, sk", [
    (MaskSpec(causal=True, q_start=64, k_start=0), 48, 48),            # FULL (past block)
    (MaskSpec(causal=True, q_start=16, k_start=16), 60, 60),           # CAUSAL
    (MaskSpec(causal=True, q_start=30, k_start=10, doc_bounds=(0, 33, 41, 120)), 50, 70),
])
def test_backend_matches_reference_backend(spec, sq, sk):
    q, k, v = inputs(2, sq, sk, 4, 2, 64, torch.float32)
    relation = classify(spec, sq, sk)
    triton_b, ref_b = TritonBackend(), ReferenceBackend()
    assert triton_b.name == "triton" and triton_b.unsupported(q, k, v, spec, relation) is None
    out, lse = triton_b.forward(q, k, v, spec, relation, 0.125)
    ref_out, ref_lse = ref_b.forward(q, k, v, spec, relation, 0.125)
    assert rel_err(out, ref_out.double()) < 1e-5
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-4
    do = torch.randn_like(q)
    for dlse in (None, torch.randn_like(lse) * finite):
        grads = triton_b.backward(do, q, k, v, out, lse, spec, relation, 0.125, dlse=dlse)
        ref_grads = ref_b.backward(do, q, k, v, ref_out, ref_lse, spec, relation, 0.125,
                                   dlse=dlse)
        for got, ref in zip(grads, ref_grads):
            assert got.shape == ref.shape
            assert rel_err(got, ref.double()) < 1e-4


def test_backend_refuses_with_one_sentence(monkeypatch):
    q = torch.randn(1, 8, 2, 32)
    spec = MaskSpec(causal=True)
    reason = TritonBackend().unsupported(q, q, q.double(), spec, Relation.CAUSAL)
    assert reason is not None and "dtype" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = TritonBackend().unsupported(q, q, q, spec, Relation.CAUSAL)
    assert reason is not None and "CUDA" in reason


@pytest.mark.parametrize("kind, d, dtype, expect", [
    ("fwd", 128, torch.bfloat16, 4),     # the four Hopper points, not the fallback
    ("fwd", 128, torch.float32, 1),      # tf32x3 tiles: the fallback is not needed
    ("dq", 256, torch.bfloat16, 1),
    ("dkdv", 64, torch.float16, 4),
])
def test_autotune_pruning_keeps_what_fits(monkeypatch, kind, d, dtype, expect):
    from lctrain_kernels.triton import configs

    monkeypatch.setattr(configs, "_max_shared_memory", lambda: 227 * 1024)  # an H100 / H200
    points = {"fwd": configs.FWD_POINTS, "dq": configs.DQ_POINTS,
              "dkdv": configs.DKDV_POINTS}[kind]
    if dtype == torch.float32:
        points = configs.FP32_POINTS[kind]
    cfgs = configs.make_configs(points)
    kept = configs.prune(kind)(cfgs, {}, HEAD_DIM_PAD=d, Q=torch.empty(0, dtype=dtype))
    assert len(kept) == expect and all(c in cfgs for c in kept)
    if expect > 1:
        assert cfgs[-1] not in kept  # the small fallback only when nothing larger fits
