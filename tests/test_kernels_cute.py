"""The flash_attn_cute backend on a CPU: a causal piece taller than wide runs as a right window,
a missing package is one sentence, and the DSL's untraced-argument warnings are dropped. FlashAttention 4's varlen kernels replaced by float64
math of their contract (``fa_contract``) run every mask shape, random blocks and dist_attention
in tests/test_kernels_ragged.py; the real kernels are checked on a GPU there and in
tests/test_bench_gpu.py."""
import warnings

import pytest
import torch

from fa_contract import fa_backward, fa_forward
from mask_cases import bounds_of
from lctrain_kernels.backends import BackendUnavailable, get_backend
from lctrain_kernels.backends.flash_attn_cute import (MIN_MAX_SEQLEN, CuteEngine, Launch,
                                                      launches, quiet_dsl)
from lctrain_kernels.masks import MaskSpec
from lctrain_kernels.ragged import plan_ragged
from test_kernels_ragged import check


ENGINE = CuteEngine(fa_forward, fa_backward)


def test_taller_causal_pieces_run_as_a_right_window():
    """A diagonal block cut by key rows: the last document's piece has more query rows than
    keys, and runs apart from the square pieces with the window that makes it top-left."""
    spec = MaskSpec(True, 0, 0, bounds_of(10, 20, 34))
    (call,) = plan_ragged(spec, 64, 40).calls
    assert call.causal and call.q_lens == (10, 20, 34) and call.k_lens == (10, 20, 10)
    square, tall = launches(call)
    assert (square.causal, square.right, square.q_rows, square.q_lens) == \
        (True, None, (0, 10), (10, 20))
    assert (tall.causal, tall.right, tall.q_rows, tall.k_rows, tall.q_lens, tall.k_lens) == \
        (False, 24, (30,), (30,), (34,), (10,))
    check(spec, 64, 40, engine=ENGINE)


def test_short_launches_tell_flash_attention_more_than_one_tile():
    """FlashAttention 4 compiles another backward where the longest entry fits one tile (at most
    256 rows): every launch states at least 257, so short documents compile nothing new, and a
    long entry states its own length."""
    engine = CuteEngine(fa_forward, fa_backward)
    for lens in ((3,), (64, 17), (128, 256)):
        args = engine._args(Launch(True, None, (0,) * len(lens), (0,) * len(lens), lens, lens),
                            torch.device("cpu"))
        assert args["max_seqlen_q"] == args["max_seqlen_k"] == MIN_MAX_SEQLEN > 256
    args = engine._args(Launch(False, 5, (0,), (0,), (900,), (895,)), torch.device("cpu"))
    assert (args["max_seqlen_q"], args["max_seqlen_k"]) == (900, 895)
    spec = MaskSpec(True, 0, 0, bounds_of(3, 60, 1))  # entries far under one tile, exact results
    check(spec, 64, 64, engine=engine)


def test_without_flash_attention_4_the_backend_says_how_to_install_it():
    try:
        import flash_attn.cute  # noqa: F401 - only whether it imports
    except ImportError:
        with pytest.raises(BackendUnavailable, match=r"pip install 'lctrain\[fa4\]'"):
            get_backend("flash_attn_cute")
    else:
        pytest.skip("FlashAttention 4 is installed here")


def test_the_dsl_untraced_argument_warning_is_dropped_and_others_pass():
    """While FlashAttention 4 compiles, the CuTe DSL warns once per argument it cannot trace;
    inside our calls exactly that warning goes, any other is shown, and afterwards it shows."""
    untraced = ("Argument aux_data (position 17) cannot be converted to a JitArgument for "
                "function 'kernel'. Its type `<class 'NoneType'>` is not supported.")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_dsl():
            warnings.warn(untraced, UserWarning)
            warnings.warn("an unrelated warning", UserWarning)
            warnings.warn(untraced, DeprecationWarning)  # another category: not ours to drop
        warnings.warn(untraced, UserWarning)  # outside our calls: shown
    assert [(str(w.message), w.category) for w in shown] == [
        ("an unrelated warning", UserWarning), (untraced, DeprecationWarning),
        (untraced, UserWarning)]
