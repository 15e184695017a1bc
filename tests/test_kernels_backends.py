"""Backend registry, the "auto" rule, and every backend against the reference (GPU ones marked)."""
import pytest
import torch

from lctrain_kernels.backends import (Backend, BackendUnavailable, available_backends,
                                      get_backend, select_backend)
from lctrain_kernels.masks import MaskSpec, Relation, classify
from lctrain_kernels.combine import merge
from lctrain_kernels.reference import reference_backward, reference_forward
from lctrain_kernels.vocabulary import BACKENDS


def qkv(b, s, hq, hkv, d, dtype, device="cpu", sk=None):
    sk = s if sk is None else sk
    return (torch.randn(b, s, hq, d, dtype=dtype, device=device),
            torch.randn(b, sk, hkv, d, dtype=dtype, device=device),
            torch.randn(b, sk, hkv, d, dtype=dtype, device=device))


def test_registry_knows_every_backend_and_loads_the_available_ones():
    names = list(BACKENDS)
    assert set(names) == {"reference", "cudnn", "triton", "cpu_flash", "cudnn_ragged",
                          "flash_attn_cute"}
    available = available_backends()
    assert "reference" in available and "cpu_flash" in available
    for name in names:
        try:
            backend = get_backend(name)
        except BackendUnavailable as exc:
            assert name not in available
            assert name in str(exc) and str(exc).endswith(".")
        else:
            assert backend.name == name and name in available
            assert isinstance(backend, Backend)  # the protocol's attributes and methods


def test_unknown_and_missing_backends_say_what_to_do():
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'fa9'; choose one"):
        get_backend("fa9")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="cudnn backend needs a CUDA GPU"):
            get_backend("cudnn")
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'flash'"):
        get_backend("flash")  # torch's FlashAttention-2 op: removed (cudnn runs those blocks)


def test_auto_rule_on_cpu_and_explicit_backends_that_cannot_run_the_block():
    q, k, v = qkv(1, 8, 2, 2, 16, torch.float32)
    causal, partial = MaskSpec(True), MaskSpec(True, q_start=4, k_start=0)
    assert select_backend("auto", q, k, v, causal, Relation.CAUSAL).name == "cpu_flash"
    assert select_backend("auto", q, k, v, partial, Relation.PARTIAL).name == "reference"
    assert select_backend("reference", q, k, v, causal, Relation.CAUSAL).name == "reference"
    with pytest.raises(BackendUnavailable, match="cpu_flash backend cannot run this partial "
                                                 "attention block: .*full or causal"):
        select_backend("cpu_flash", q, k, v, partial, Relation.PARTIAL)
    own = get_backend("reference")  # a Backend object passes straight through
    assert select_backend(own, q, k, v, partial, Relation.PARTIAL) is own
    with pytest.raises(BackendUnavailable, match="no attention backend can run"):
        qi = q.to(torch.int32)
        select_backend("auto", qi, qi, qi, partial, Relation.PARTIAL)


def check_backend(backend, dtype, device, fwd_tol, bwd_tol):
    """A FULL block and a CAUSAL block of the same queries, merged, then both backwards: from
    the output's gradient alone, and with a gradient of the merged lse too."""
    s, hq, hkv, d = 48, 4, 2, 64
    q, k, v = qkv(2, s, hq, hkv, d, dtype, device, sk=2 * s)
    scale = d ** -0.5
    whole = MaskSpec(True, q_start=s, k_start=0)  # queries s..2s, keys 0..2s
    ref_out, ref_lse = reference_forward(q.double(), k.double(), v.double(), whole, scale)
    dout = torch.randn_like(q)
    blocks = [(MaskSpec(True, s, 0), slice(0, s)), (MaskSpec(True, s, s), slice(s, 2 * s))]
    assert [classify(sp, s, s) for sp, _ in blocks] == [Relation.FULL, Relation.CAUSAL]
    parts = []
    for spec, keys in blocks:
        rel = classify(spec, s, s)
        assert backend.unsupported(q, k[:, keys], v[:, keys], spec, rel) is None
        out, lse = backend.forward(q, k[:, keys], v[:, keys], spec, rel, scale)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, hq, s)
        parts.append((out, lse))
    out, lse = merge(*parts[0], *parts[1])
    rel_err = lambda got, want: ((got.double() - want).abs().max() / want.abs().max()).item()
    assert rel_err(out, ref_out) < fwd_tol
    assert (lse.double() - ref_lse).abs().max().item() < fwd_tol
    for dlse in (None, torch.randn(lse.shape, dtype=lse.dtype, device=device)):
        ref = reference_backward(dout.double(), q.double(), k.double(), v.double(), ref_out,
                                 ref_lse, whole, scale,
                                 dlse=None if dlse is None else dlse.double())
        dq, dks, dvs = 0, [], []
        for spec, keys in blocks:
            g = backend.backward(dout, q, k[:, keys], v[:, keys], out.to(dtype), lse, spec,
                                 classify(spec, s, s), scale, dlse=dlse)
            dq = dq + g[0].double()
            dks.append(g[1].double())
            dvs.append(g[2].double())
        for got, want in zip((dq, torch.cat(dks, 1), torch.cat(dvs, 1)), ref):
            assert got.shape == want.shape
            assert rel_err(got, want) < bwd_tol, (backend.name, dlse is not None)


# torch's CPU flash kernel in float64 now and then lands up to ~6e-10 off on a whole batch of the
# same inputs (a fresh process, about one in twenty): still far below float32's rounding
F64_TOL = 1e-8


@pytest.mark.parametrize("dtype, fwd_tol, bwd_tol", [(torch.float64, F64_TOL, F64_TOL),
                                                      (torch.float32, 1e-5, 1e-4),
                                                      (torch.bfloat16, 2e-2, 4e-2)])
def test_cpu_flash_backend_matches_reference_across_merged_blocks(dtype, fwd_tol, bwd_tol):
    check_backend(get_backend("cpu_flash"), dtype, "cpu", fwd_tol, bwd_tol)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cudnn", "triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_backend_matches_reference_across_merged_blocks(name, dtype):
    try:
        backend = get_backend(name)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    check_backend(backend, dtype, "cuda", 1e-2, 3e-2)


def check_top_left_causal(backend, dtype, device, tol):
    """Non-square CAUSAL blocks (q_start == k_start): all rows against the first part of the keys
    (distflash's first diagonal piece) and a few rows against more keys, forward and backward."""
    for sq, sk in ((40, 24), (16, 40)):
        q, k, v = qkv(2, sq, 4, 2, 64, dtype, device, sk=sk)
        spec, scale = MaskSpec(True, 8, 8), 64 ** -0.5
        rel = classify(spec, sq, sk)
        assert rel is Relation.CAUSAL and backend.unsupported(q, k, v, spec, rel) is None
        out, lse = backend.forward(q, k, v, spec, rel, scale)
        ref_out, ref_lse = reference_forward(q.double(), k.double(), v.double(), spec, scale)
        dout = torch.randn_like(q)
        grads = backend.backward(dout, q, k, v, out, lse, spec, rel, scale)
        ref = reference_backward(dout.double(), q.double(), k.double(), v.double(), ref_out,
                                 ref_lse, spec, scale)
        for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref)):
            err = (got.double() - want).abs().max() / want.abs().max()
            assert err.item() < tol, (backend.name, sq, sk)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, F64_TOL), (torch.float32, 1e-5)])
def test_cpu_flash_aligns_a_non_square_causal_block_top_left(dtype, tol):
    check_top_left_causal(get_backend("cpu_flash"), dtype, "cpu", tol)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cudnn", "triton", "reference"])
def test_gpu_backends_align_a_non_square_causal_block_top_left(name):
    try:
        backend = get_backend(name)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    check_top_left_causal(backend, torch.bfloat16, "cuda", 2e-2)


@pytest.mark.gpu
def test_auto_picks_flash_attn_cute_then_cudnn_for_dense_half_blocks_on_gpu():
    q, k, v = qkv(1, 64, 2, 2, 64, torch.bfloat16, "cuda")
    chosen = select_backend("auto", q, k, v, MaskSpec(True), Relation.CAUSAL)
    assert chosen.name == ("flash_attn_cute" if "flash_attn_cute" in available_backends()
                           else "cudnn")
    with pytest.raises(BackendUnavailable, match="cudnn backend cannot run this partial"):
        select_backend("cudnn", q, k, v, MaskSpec(True, 32, 0), Relation.PARTIAL)
