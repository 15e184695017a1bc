"""Mask shapes and document helpers shared by the kernel tests."""
import math
import random

import torch

from lctrain_kernels.masks import MaskSpec, dense_mask


def bounds_of(*lengths: int) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


#: name -> (spec, sq, sk): every mask shape a document-masked backend must get right.
SHAPES = {
    "many_short": (MaskSpec(True, 0, 0, bounds_of(*([9, 5, 12, 3, 7] * 6), 44)), 150, 150),
    "few_long_with_tails": (MaskSpec(True, 0, 0, bounds_of(70, 41, 33)), 144, 144),
    "one_doc_over_the_block": (MaskSpec(True, 40, 0, bounds_of(300)), 56, 90),
    "doc_crossing_chunks": (MaskSpec(True, 64, 0, bounds_of(20, 90, 50)), 64, 64),
    "offset_keys_into_queries": (MaskSpec(True, 40, 24, bounds_of(30, 44, 6, 50)), 60, 64),
    "keys_end_inside_a_doc": (MaskSpec(True, 0, 0, bounds_of(10, 60, 30)), 100, 45),
    "zero_length_intersection": (MaskSpec(True, 50, 10, bounds_of(30, 25, 45)), 50, 30),
    "not_causal": (MaskSpec(False, 0, 16, bounds_of(23, 40, 17, 30)), 70, 80),
    "offset_without_docs": (MaskSpec(True, 48, 16, None), 40, 64),
    "ragged_then_short": (MaskSpec(True, 0, 0, bounds_of(11, 20, 11, 5, 30, 11, 6, 9)), 103, 103),
}

def visible(spec: MaskSpec, sq: int, sk: int) -> torch.Tensor:
    mask = dense_mask(spec, sq, sk)
    return torch.ones(sq, sk, dtype=torch.bool) if mask is None else mask


def random_block(rng: random.Random):
    n = rng.randint(2, 90)
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(12, n - 1))))
    bounds = tuple([0, *cuts, n]) if rng.random() < 0.85 else None
    q0, k0 = rng.randint(0, n - 1), rng.randint(0, n - 1)
    if rng.random() < 0.4:
        k0 = q0
    sq, sk = rng.randint(1, n - q0), rng.randint(1, n - k0)
    return MaskSpec(rng.random() < 0.8, q0, k0, bounds), sq, sk


def lognormal_lengths(total: int, median: float, sigma: float, seed: int) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(max(1, round(rng.lognormvariate(math.log(median), sigma))),
                       total - sum(out)))
    return out
