"""Tokenize documents and pack them into rows of exactly ``seq_len`` tokens.

All documents are laid end to end in one token stream (each ends in eos) and the stream is cut
every ``seq_len`` tokens. Nothing is lost or duplicated: a document longer than the rest of a row
continues at the start of the next row, and only the very last row is padded (pad tokens, label
-100, forming their own document). Each row carries:

* ``input_ids``     — the row's tokens;
* ``labels``        — the next token, shifted HERE, before the row is ever split across cp ranks
  (so no token is lost at a shard boundary). With ``document_mask`` the label of token i is token
  i+1 of the same document (continuing into the next row when the document does), and -100 at a
  document's last token; without it, the label is the next token of the row (crossing documents)
  and -100 at the row's last token. Padding is always -100;
* ``position_ids``  — restarting at 0 for every document piece of the row with
  ``document_mask``, else 0..S-1;
* ``doc_lens``      — the lengths of the row's attention segments, summing to S: its document
  pieces (then the padding) with ``document_mask``, else one segment ``[S]``.

Tokenizing uses ``datasets.map(batched=True)`` (cached next to the source under
``data.cache_dir``); packing is a batched map over row numbers, cached there too, keyed by a hash
of the token stream and the packing settings.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from lctrain.config import RecipeConfig
from lctrain.data.sources import load_documents
from lctrain.data.tokenizer import encode_documents, pad_token_id
from lctrain.errors import DataError

IGNORE = -100
"""Label of positions that contribute no loss."""

_FORMAT = 1
"""Bumped whenever the packed layout changes, so stale caches are never reused."""

_TOKENS = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
_ROWS = datasets.Features({name: datasets.Sequence(datasets.Value("int32"))
                          for name in ("input_ids", "labels", "position_ids", "doc_lens")})


def build_packed_dataset(cfg: RecipeConfig, tokenizer: Any) -> datasets.Dataset:
    """Load, tokenize and pack ``cfg.data`` into rows of exactly ``cfg.data.seq_len`` tokens.

    Raises:
        DataError: the source cannot be read, or yields no token.
    """
    documents, column = load_documents(cfg.data)
    tokens = tokenize(documents, tokenizer, column, in_memory=cfg.data.cache_dir is None)
    return pack(tokens, seq_len=cfg.data.seq_len, document_mask=cfg.data.document_mask,
                pad_id=pad_token_id(tokenizer), cache_dir=cfg.data.cache_dir)


def tokenize(documents: datasets.Dataset, tokenizer: Any, column: str, *,
             in_memory: bool) -> datasets.Dataset:
    """One row of ``input_ids`` (int32, ending in eos) per document, via a batched map."""
    return documents.map(_encode_batch, batched=True, batch_size=256, features=_TOKENS,
                         fn_kwargs={"tokenizer": tokenizer, "column": column},
                         remove_columns=documents.column_names, keep_in_memory=in_memory,
                         desc="tokenize")


def _encode_batch(batch: dict[str, list], tokenizer: Any, column: str) -> dict[str, list]:
    texts = ["" if text is None else str(text) for text in batch[column]]
    return {"input_ids": encode_documents(tokenizer, texts)}


def pack(tokens: datasets.Dataset, *, seq_len: int, document_mask: bool, pad_id: int,
         cache_dir: str | None = None) -> datasets.Dataset:
    """Pack tokenized documents (an ``input_ids`` column) into rows; see the module docstring.

    Raises:
        DataError: the documents hold no token at all.
    """
    stream = TokenStream.from_dataset(tokens)
    if stream.total == 0:
        raise DataError("the data yields no token to train on; check data.source and data.text_field")
    n_rows = -(-stream.total // seq_len)
    digest = stream.digest(seq_len, document_mask, pad_id)
    kwargs: dict[str, Any] = {"keep_in_memory": cache_dir is None}
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        kwargs["cache_file_name"] = os.path.join(cache_dir, f"lctrain-packed-{digest}.arrow")
    rows = datasets.Dataset.from_dict({"row": np.arange(n_rows, dtype=np.int64)})
    return rows.map(_pack_batch, batched=True, batch_size=64, features=_ROWS,
                    remove_columns=["row"], new_fingerprint=digest, desc="pack",
                    fn_kwargs={"stream": stream, "seq_len": seq_len,
                               "document_mask": document_mask, "pad_id": pad_id}, **kwargs)


class TokenStream:
    """All documents end to end: ``ids`` (T,), ``bounds`` (n_docs + 1,) document starts + T."""

    def __init__(self, ids: np.ndarray, bounds: np.ndarray) -> None:
        self.ids, self.bounds = ids, bounds
        self.total = int(ids.shape[0])
        self.next_in_doc = self._shifted_within_documents()

    @classmethod
    def from_dataset(cls, tokens: datasets.Dataset) -> TokenStream:
        table = tokens.with_format("arrow")[:]
        column = table.column("input_ids").combine_chunks()
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        ids = column.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
        bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        return cls(ids, bounds)

    def _shifted_within_documents(self) -> np.ndarray:
        labels = np.full(self.total, IGNORE, dtype=np.int32)  # (T,)
        labels[:-1] = self.ids[1:]
        last = self.bounds[1:] - 1  # each document's last token (empty documents repeat one)
        labels[last[last >= 0]] = IGNORE
        return labels

    def digest(self, *settings: Any) -> str:
        """A hash of the stream and ``settings``: the packed cache's key."""
        h = hashlib.blake2b(digest_size=12)
        for part in (self.ids, self.bounds):
            h.update(np.ascontiguousarray(part).tobytes())
        h.update(repr((_FORMAT, *settings)).encode())
        return h.hexdigest()


def pack_row(stream: TokenStream, row: int, seq_len: int, document_mask: bool,
             pad_id: int) -> dict[str, np.ndarray]:
    """Row ``row`` of the packed stream: input_ids, labels, position_ids (S,) and doc_lens."""
    lo, hi = row * seq_len, min((row + 1) * seq_len, stream.total)
    pad = seq_len - (hi - lo)
    input_ids = np.concatenate([stream.ids[lo:hi], np.full(pad, pad_id, np.int32)])  # (S,)
    if document_mask:
        labels = stream.next_in_doc[lo:hi]
        inner = stream.bounds[(stream.bounds > lo) & (stream.bounds < hi)]
        edges = np.unique(np.concatenate([[lo], inner, [hi]]))
        doc_lens = np.diff(edges)
    else:
        labels = np.concatenate([stream.ids[lo + 1:hi], [IGNORE]]).astype(np.int32)
        doc_lens = np.array([hi - lo])
    labels = np.concatenate([labels, np.full(pad, IGNORE, np.int32)])  # (S,)
    if pad and document_mask:
        doc_lens = np.concatenate([doc_lens, [pad]])
    elif pad:
        doc_lens = np.array([seq_len])
    starts = np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)  # (S,) first index of own segment
    position_ids = np.arange(seq_len) - starts  # (S,)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "doc_lens": doc_lens}


def _pack_batch(batch: dict[str, list], stream: TokenStream, seq_len: int, document_mask: bool,
                pad_id: int) -> dict[str, list]:
    out: dict[str, list] = {name: [] for name in _ROWS}
    for row in batch["row"]:
        for name, value in pack_row(stream, int(row), seq_len, document_mask, pad_id).items():
            out[name].append(value)
    return out
