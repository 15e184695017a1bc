"""Mask relations: classify and dense_mask against a brute-force visibility rule."""
import random

import pytest
import torch

from lctrain_kernels.masks import MaskSpec, Relation, classify, dense_mask, doc_bounds_from


def brute_visible(spec: MaskSpec, sq: int, sk: int) -> torch.Tensor:
    """(sq, sk) bool by the definition: causal j <= i, same document."""
    def doc(pos):
        return sum(1 for b in spec.doc_bounds[1:] if b <= pos)

    out = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            qi, kj = spec.q_start + i, spec.k_start + j
            ok = not spec.causal or kj <= qi
            if spec.doc_bounds is not None:
                ok = ok and doc(qi) == doc(kj)
            out[i, j] = ok
    return out


def expected_relation(spec, sq, sk, vis) -> Relation:
    if not vis.any():
        return Relation.EMPTY
    if vis.all():
        return Relation.FULL
    # the triangle from the top-left corner (what torch's SDPA kernels compute), any sq and sk
    if (spec.causal and spec.q_start == spec.k_start
            and torch.equal(vis, torch.ones(sq, sk, dtype=torch.bool).tril())):
        return Relation.CAUSAL
    return Relation.PARTIAL


def random_spec(rng: random.Random, n: int):
    bounds = None
    if rng.random() < 0.6:
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(6, n - 1))))
        bounds = tuple([0, *cuts, n])
    sq, sk = rng.randint(1, 12), rng.randint(1, 12)
    q0, k0 = rng.randint(0, n - sq), rng.randint(0, n - sk)
    if rng.random() < 0.25:  # diagonal blocks, the CAUSAL candidates
        sk, k0 = sq, q0
    elif rng.random() < 0.2:  # a diagonal block's rows against part of its keys, or the reverse
        k0 = q0 = min(q0, k0)
    return MaskSpec(rng.random() < 0.7, q0, k0, bounds), sq, sk


def test_classify_and_dense_mask_match_brute_force_on_random_blocks():
    rng = random.Random(torch.randint(0, 2**31, ()).item())
    seen = set()
    for _ in range(400):
        spec, sq, sk = random_spec(rng, 24)
        vis = brute_visible(spec, sq, sk)
        rel = classify(spec, sq, sk)
        assert rel is expected_relation(spec, sq, sk, vis), (spec, sq, sk)
        mask = dense_mask(spec, sq, sk)
        if rel is Relation.FULL:
            assert mask is None
        else:
            assert torch.equal(mask, vis), (spec, sq, sk)
        seen.add(rel)
    assert seen == set(Relation)


@pytest.mark.parametrize("spec, sq, sk, rel", [
    (MaskSpec(True, 0, 0), 8, 8, Relation.CAUSAL),
    (MaskSpec(True, 8, 0), 8, 8, Relation.FULL),        # DistFlashAttn block below diagonal
    (MaskSpec(True, 0, 8), 8, 8, Relation.EMPTY),       # above the diagonal
    (MaskSpec(True, 4, 0), 8, 8, Relation.PARTIAL),     # offset diagonal
    (MaskSpec(True, 0, 0), 4, 8, Relation.CAUSAL),      # more keys than queries: top-left
    (MaskSpec(True, 0, 0), 8, 4, Relation.CAUSAL),      # all rows x first half of the keys
    (MaskSpec(True, 4, 4, (0, 6, 16)), 2, 8, Relation.CAUSAL),  # later document: never seen
    (MaskSpec(True, 4, 4, (0, 6, 16)), 4, 4, Relation.PARTIAL),
    (MaskSpec(False, 0, 8), 8, 8, Relation.FULL),
    (MaskSpec(True, 0, 0, (0, 8, 16)), 8, 8, Relation.CAUSAL),
    (MaskSpec(True, 0, 0, (0, 4, 16)), 8, 8, Relation.PARTIAL),
    (MaskSpec(True, 8, 0, (0, 8, 16)), 8, 8, Relation.EMPTY),   # other document
    (MaskSpec(False, 8, 0, (0, 8, 16)), 8, 8, Relation.EMPTY),
    (MaskSpec(False, 0, 0, (0, 16)), 8, 8, Relation.FULL),
    (MaskSpec(True, 0, 0), 1, 1, Relation.FULL),
    (MaskSpec(True, 0, 0), 0, 8, Relation.EMPTY),
])
def test_classify_known_blocks(spec, sq, sk, rel):
    assert classify(spec, sq, sk) is rel


def test_many_documents_between_block_ends_are_visible():
    bounds = tuple(range(0, 1001, 10))  # 100 documents of 10 tokens
    assert classify(MaskSpec(True, 100, 100, bounds), 500, 500) is Relation.PARTIAL
    # documents 0..9 for keys, 20..29 for queries: nothing shared
    assert classify(MaskSpec(True, 200, 0, bounds), 100, 100) is Relation.EMPTY


def test_doc_bounds_from_reads_tensors_lists_and_none():
    assert doc_bounds_from(None) is None
    assert doc_bounds_from(torch.tensor([0, 3, 9], dtype=torch.int32)) == (0, 3, 9)
    assert doc_bounds_from([0, 5]) == (0, 5)
    assert all(type(x) is int for x in doc_bounds_from(torch.tensor([0, 2, 4])))


@pytest.mark.parametrize("bad, words", [
    ([1, 5], "start at 0"),
    ([0], "start at 0"),
    ([0, 4, 4, 8], "strictly increasing"),
    ([0, 6, 3], "strictly increasing"),
    (torch.tensor([[0, 4]]), "1-D integer"),
    (torch.tensor([0.0, 4.0]), "1-D integer"),
])
def test_doc_bounds_from_rejects_bad_cu_seqlens(bad, words):
    with pytest.raises(ValueError, match=words):
        doc_bounds_from(bad)


def test_mask_spec_checks_its_fields():
    with pytest.raises(ValueError, match=">= 0"):
        MaskSpec(True, -1, 0)
    with pytest.raises(TypeError, match="tuple"):
        MaskSpec(True, 0, 0, [0, 4])
    with pytest.raises(ValueError, match="cover the whole sequence"):
        classify(MaskSpec(True, 0, 0, (0, 4)), 8, 8)
