"""Packing samples into rows of exactly ``seq_len`` tokens, with labels shifted before any split.

The samples lie end to end in one token stream (`TokenStream`: ids, per-token target flags and
the sample boundaries). A row is a list of pieces of that stream, padded at the end; how the
pieces are chosen is ``data.long_samples`` (`plan_rows`):

* ``split`` — the stream is cut every seq_len tokens: one piece per row, nothing lost or
  duplicated, a sample longer than the rest of a row continuing at the start of the next, only
  the very last row padded;
* ``truncate_left`` / ``truncate_right`` / ``drop`` — every sample lies whole in one row. A
  sample longer than seq_len keeps its last / first seq_len tokens, or is left out (with
  truncation, one that keeps no target token is left out too). Rows are filled best-fit
  decreasing (each sample, longest first, goes into the fullest row it still fits; a new row
  when none) and padded; within a row the samples keep their order.

Each row (`PackedRows.row`) carries:

* ``input_ids``    — the row's tokens, then padding;
* ``labels``       — the next token where it is a target, else -100, computed HERE, before the
  row is ever split across cp ranks (so no label is lost at a shard boundary). With
  ``document_mask`` the next token is the next one of the same sample (which may lie past the
  row's end when a sample continues or was truncated on the right) and a sample's last token
  has no label; without it, the next token of the row (crossing samples) and none at the last
  one. Padding never has a label;
* ``position_ids`` — restarting at 0 for every sample piece with ``document_mask``, else 0..S-1;
* ``doc_lens``     — the row's attention segments, summing to S: its sample pieces (then the
  padding) with ``document_mask``, else ``[S]``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lctrain.errors import DataError

IGNORE = -100
"""Label of positions that contribute no loss."""

WHOLE_SAMPLE_MODES = ("truncate_left", "truncate_right", "drop")
"""``long_samples`` values that keep each sample inside one row."""


@dataclass(frozen=True)
class TokenStream:
    """All samples end to end."""

    ids: np.ndarray
    """(T,) int32 token ids (may be a read-only memory map)."""
    targets: np.ndarray
    """(T,) bool or uint8: the token is trained on."""
    bounds: np.ndarray
    """(n + 1,) int64 sample starts, then T."""

    @classmethod
    def from_samples(cls, ids: Sequence[Sequence[int]],
                     targets: Sequence[Sequence[bool]] | None = None) -> TokenStream:
        """A stream of in-memory samples (every token a target unless ``targets`` says)."""
        lengths = [len(x) for x in ids]
        flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=sum(lengths))
        flags = (np.ones(flat.size, bool) if targets is None else
                 np.fromiter((bool(t) for x in targets for t in x), dtype=bool, count=flat.size))
        return cls(flat, flags, np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))

    @property
    def total(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class RowPlan:
    """Which stream pieces make each row, and what happened to samples longer than a row."""

    starts: np.ndarray
    """(pieces,) int64 stream start of each piece."""
    stops: np.ndarray
    """(pieces,) int64 stream stop of each piece."""
    offsets: np.ndarray
    """(rows + 1,) int64: row r is pieces offsets[r]:offsets[r+1]."""
    long: int = 0
    """Samples longer than seq_len (split: continued in the next row; else truncated or left out)."""
    left_out: int = 0
    """Samples left out: too long under ``drop``, or no target token left after truncation."""
    first_long: int = -1
    """Index of the first sample longer than seq_len, -1 if none."""

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)


def plan_rows(stream: TokenStream, seq_len: int, mode: str,
              samples: np.ndarray | None = None) -> RowPlan:
    """Choose the pieces of every row (see the module docstring).

    Args:
        stream: the samples.
        seq_len: tokens per row.
        mode: ``split``, ``truncate_left``, ``truncate_right`` or ``drop``.
        samples: sorted indices of the samples to pack (a training or validation part, see
            `lctrain.data.split`); None = all. Under ``split`` the chosen samples lie end to
            end in their order, so a row may hold pieces of samples that are not neighbours in
            the stream.

    Raises:
        DataError: the stream (or the chosen part) has no token, or every sample was left out.
    """
    chosen = np.arange(stream.bounds.size - 1) if samples is None else np.asarray(samples,
                                                                                 np.int64)
    lengths = np.diff(stream.bounds)[chosen]
    if int(lengths.sum()) == 0:
        raise DataError("the data yields no token to train on; check data.source and data.format")
    too_long = chosen[lengths > seq_len]
    first = int(too_long[0]) if too_long.size else -1
    if mode == "split" and samples is None:  # the whole stream: one piece per row
        starts = np.arange(0, stream.total, seq_len, dtype=np.int64)
        return RowPlan(starts, np.minimum(starts + seq_len, stream.total),
                       np.arange(starts.size + 1, dtype=np.int64), int(too_long.size), 0, first)
    if mode == "split":
        starts, stops, offsets = _split_pieces(stream.bounds, chosen, seq_len)
        return RowPlan(starts, stops, offsets, int(too_long.size), 0, first)
    if mode not in WHOLE_SAMPLE_MODES:
        raise ValueError(f"unknown long_samples mode {mode!r}")
    starts, stops = stream.bounds[chosen].copy(), stream.bounds[chosen + 1].copy()
    long_at = np.flatnonzero(lengths > seq_len)
    if mode == "truncate_left":
        starts[long_at] = stops[long_at] - seq_len
    elif mode == "truncate_right":
        stops[long_at] = starts[long_at] + seq_len
    keep = np.ones(chosen.size, bool)
    if mode == "drop":
        keep[long_at] = False
    else:
        for s in long_at:
            keep[s] = bool(np.any(stream.targets[starts[s]:stops[s]]))
    kept = np.flatnonzero(keep)
    if kept.size == 0:
        raise DataError(f"every sample is longer than data.seq_len {seq_len} and data.long_samples "
                        f"is {mode}, which leaves nothing to train on; raise data.seq_len or use "
                        f"truncate_left / truncate_right")
    rows = _best_fit(stops[kept] - starts[kept], seq_len)
    order = np.lexsort((kept, rows))  # by row, then sample order
    counts = np.bincount(rows, minlength=int(rows.max()) + 1)
    return RowPlan(starts[kept][order], stops[kept][order],
                   np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                   int(too_long.size), int(chosen.size - kept.size), first)


def _split_pieces(bounds: np.ndarray, chosen: np.ndarray,
                  seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, stops, offsets) of ``split`` rows over the chosen samples laid end to end: a
    piece ends at every sample end and every multiple of seq_len of the joined tokens."""
    lengths = bounds[chosen + 1] - bounds[chosen]
    joined = np.concatenate([[0], np.cumsum(lengths)])  # sample starts in the joined tokens
    total = int(joined[-1])
    cuts = np.union1d(joined, np.arange(0, total, seq_len, dtype=np.int64))
    cuts = cuts[cuts < total]  # (pieces,) joined start of each piece
    ends = np.append(cuts[1:], total)
    sample = np.searchsorted(joined, cuts, side="right") - 1  # which chosen sample holds it
    keep = ends > cuts  # empty samples make empty pieces
    cuts, ends, sample = cuts[keep], ends[keep], sample[keep]
    starts = bounds[chosen[sample]] + (cuts - joined[sample])
    rows = cuts // seq_len
    counts = np.bincount(rows, minlength=int(rows.max()) + 1)
    return (starts.astype(np.int64), (starts + ends - cuts).astype(np.int64),
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))


def _best_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Row number of each item under best-fit decreasing; rows numbered by their first item."""
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted
    row_of = np.empty(lengths.size, dtype=np.int64)
    n_rows = 0
    for i in np.argsort(-lengths, kind="stable"):
        need = int(lengths[i])
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row, n_rows = capacity, n_rows, n_rows + 1
        row_of[i] = row
        if room - need:
            bisect.insort(free, (room - need, row))
    first_item = np.full(n_rows, lengths.size, dtype=np.int64)
    np.minimum.at(first_item, row_of, np.arange(lengths.size))
    renumber = np.empty(n_rows, dtype=np.int64)
    renumber[np.argsort(first_item, kind="stable")] = np.arange(n_rows)
    return renumber[row_of]


class PackedRows:
    """The packed rows of a token stream: ``len(rows)``, ``rows[r]`` / ``rows.row(r)``.

    Args:
        stream: the samples.
        plan: the rows' pieces (`plan_rows`).
        seq_len, document_mask, pad_id: the row length, whether samples are kept apart, and
            the id written into padding.
        info: what the preparation reports (format, counts, cache; see `lctrain.data.prepare`).
    """

    def __init__(self, stream: TokenStream, plan: RowPlan, *, seq_len: int, document_mask: bool,
                 pad_id: int, info: dict[str, Any] | None = None) -> None:
        self.stream, self.plan = stream, plan
        self.seq_len, self.document_mask, self.pad_id = seq_len, document_mask, pad_id
        self.info = dict(info or {})

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, r: int) -> dict[str, np.ndarray]:
        return self.row(r)

    def row(self, r: int) -> dict[str, np.ndarray]:
        """Row ``r``: input_ids, labels, position_ids (S,) int64 and doc_lens."""
        if not 0 <= r < len(self):
            raise IndexError(f"row {r} of {len(self)}")
        lo, hi = int(self.plan.offsets[r]), int(self.plan.offsets[r + 1])
        spans = list(zip(self.plan.starts[lo:hi].tolist(), self.plan.stops[lo:hi].tolist()))
        ids = np.concatenate([self.stream.ids[a:b] for a, b in spans]).astype(np.int64)  # (n,)
        pad = self.seq_len - ids.size
        if self.document_mask:
            labels = np.concatenate([self._labels_within_samples(a, b) for a, b in spans])
            doc_lens = [n for a, b in spans for n in self._segments(a, b)] + ([pad] if pad else [])
        else:
            flags = np.concatenate([self.stream.targets[a:b] for a, b in spans]).astype(bool)
            labels = np.full(ids.size, IGNORE, dtype=np.int64)
            labels[:-1] = np.where(flags[1:], ids[1:], IGNORE)
            doc_lens = [self.seq_len]
        doc_lens = np.asarray(doc_lens, dtype=np.int64)
        starts = np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)  # (S,) own segment's start
        return {"input_ids": np.concatenate([ids, np.full(pad, self.pad_id, np.int64)]),
                "labels": np.concatenate([labels, np.full(pad, IGNORE, np.int64)]),
                "position_ids": np.arange(self.seq_len, dtype=np.int64) - starts,
                "doc_lens": doc_lens}

    def _labels_within_samples(self, a: int, b: int) -> np.ndarray:
        """Labels of stream positions a..b-1: the next token of the same sample if a target."""
        bounds, total = self.stream.bounds, self.stream.total
        nxt = np.arange(a + 1, b + 1, dtype=np.int64)  # (n,)
        sample_end = bounds[np.searchsorted(bounds, nxt - 1, side="right")]
        at = np.minimum(nxt, total - 1)
        ok = (nxt < sample_end) & self.stream.targets[at].astype(bool)
        return np.where(ok, self.stream.ids[at], IGNORE).astype(np.int64)

    def _segments(self, a: int, b: int) -> list[int]:
        """Lengths of the sample pieces that make up stream span a..b."""
        bounds = self.stream.bounds
        inner = bounds[np.searchsorted(bounds, a, side="right"):np.searchsorted(bounds, b, side="left")]
        return np.diff(np.concatenate([[a], inner, [b]])).tolist()


def pack(samples: Sequence[Sequence[int]], *, seq_len: int, document_mask: bool, pad_id: int,
         targets: Sequence[Sequence[bool]] | None = None, long_samples: str = "split") -> PackedRows:
    """Pack in-memory samples (token id lists) into rows; see the module docstring.

    Args:
        samples: token ids of each sample.
        seq_len, document_mask, pad_id: as `PackedRows`.
        targets: per-token target flags of each sample (default: every token).
        long_samples: ``split``, ``truncate_left``, ``truncate_right`` or ``drop``.

    Raises:
        DataError: the samples hold no token, or all are left out.
    """
    stream = TokenStream.from_samples(samples, targets)
    return PackedRows(stream, plan_rows(stream, seq_len, long_samples), seq_len=seq_len,
                      document_mask=document_mask, pad_id=pad_id)
