"""Validation data held out of the training source, document by document, before packing.

With ``data.eval_fraction`` = f, ``round(f × n)`` of the source's n documents (the samples its
records became; records skipped as empty make none) are chosen at random by ``data.eval_seed``
and set aside: the training rows are packed from the other documents, the validation rows from
these, each part on its own (`lctrain.data.packing.plan_rows` with the part's sample indices).
So no token of a held-out document is ever trained on, and no training row borrows one; the
same source, seed and fraction hold out the same documents in every run, whatever the
sequence length, the tokenizer's speed or the number of ranks. The token stream in the data
cache is shared by both parts: only the row plans differ.
"""
from __future__ import annotations

import numpy as np

from lctrain.config import DataConfig
from lctrain.errors import DataError

PARTS = ("train", "eval")
"""The two parts of a source: what is trained on, what is held out for validation."""


def held_out(documents: int, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of the documents held out for validation.

    Args:
        documents: documents (samples) in the source.
        fraction: ``data.eval_fraction``, in (0, 1).
        seed: ``data.eval_seed``.

    Returns:
        (round(fraction × documents),) int64, sorted.

    Raises:
        DataError: the fraction holds out no document, or every document.
    """
    count = int(round(fraction * documents))
    if count < 1:
        raise DataError(f"data.eval_fraction {fraction:g} of {documents} documents holds out "
                        f"none; raise it to at least {1 / documents:.2g} or use "
                        f"data.eval_source")
    if count >= documents:
        raise DataError(f"data.eval_fraction {fraction:g} of {documents} documents holds out all "
                        f"of them and leaves none to train on; lower it or use data.eval_source")
    rng = np.random.default_rng([seed, documents])
    return np.sort(rng.choice(documents, size=count, replace=False)).astype(np.int64)


def part_samples(data: DataConfig, part: str, documents: int) -> np.ndarray | None:
    """The sample indices of ``part`` of ``data.source``, or None for all of them.

    Args:
        data: the data settings.
        part: ``train`` or ``eval`` (the held-out documents of data.eval_fraction).
        documents: documents in the source.

    Raises:
        DataError: see `held_out`.
        ValueError: ``eval`` without data.eval_fraction, or an unknown part.
    """
    if part not in PARTS:
        raise ValueError(f"unknown data part {part!r}; use one of {PARTS}")
    if data.eval_fraction == 0:
        if part == "eval":
            raise ValueError("the eval part of data.source needs data.eval_fraction > 0")
        return None
    chosen = held_out(documents, data.eval_fraction, data.eval_seed)
    if part == "eval":
        return chosen
    keep = np.ones(documents, bool)
    keep[chosen] = False
    return np.flatnonzero(keep).astype(np.int64)
