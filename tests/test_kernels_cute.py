"""The flash_attn_cute backend's block logic on a CPU: FlashAttention 4's varlen kernels are
replaced by float64 math of their contract (``fa_contract``), so the launches, offsets and
statistics layout of :class:`CuteEngine` are checked against the float64 oracle of whole blocks
(inside dist_attention too: tests/test_kernels_ragged.py). The real kernels are checked on a GPU
(tests/test_kernels_ragged.py, tests/test_bench_gpu.py)."""
import random

import pytest

from fa_contract import fa_backward, fa_forward
from mask_cases import SHAPES, bounds_of, random_block
from lctrain_kernels.backends import BackendUnavailable, get_backend
from lctrain_kernels.backends.flash_attn_cute import CuteEngine, launches
from lctrain_kernels.masks import MaskSpec, Relation, classify
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


@pytest.mark.parametrize("name", list(SHAPES))
def test_block_logic_matches_float64_reference_on_every_mask_shape(name, poisoned):
    spec, sq, sk = SHAPES[name]
    for hkv, batch in ((2, 2), (4, 1), (1, 1)):  # GQA, MHA, MQA; batched and not
        check(spec, sq, sk, engine=ENGINE, hkv=hkv, batch=batch)


def test_block_logic_on_random_blocks(poisoned):
    rng = random.Random()
    for _ in range(40):
        spec, sq, sk = random_block(rng)
        if classify(spec, sq, sk) is Relation.EMPTY:  # never handed to a backend
            continue
        check(spec, sq, sk, engine=ENGINE, lse_grad=rng.random() < 0.5)


def test_without_flash_attention_4_the_backend_says_how_to_install_it():
    try:
        import flash_attn.cute  # noqa: F401 - only whether it imports
    except ImportError:
        with pytest.raises(BackendUnavailable, match=r"pip install 'lctrain\[fa4\]'"):
            get_backend("flash_attn_cute")
    else:
        pytest.skip("FlashAttention 4 is installed here")
