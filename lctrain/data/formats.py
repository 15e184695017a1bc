"""Records → samples: token ids and which of them are training targets.

A sample is ``(ids, targets)``: int32 token ids and a bool flag per token saying whether the
model is trained to predict that token from the ones before it. Packing turns the flags into
labels (the label of position i is token i+1 when token i+1 is a target, else -100), so a loss
mask is a property of the tokens and survives packing, shifting and sharding unchanged.

Formats (``data.format``):

* ``text`` — the string in ``data.text_field``, tokenized as a document (bos/eos as the
  tokenizer adds them, always ending in eos); every token is a target;
* ``prompt_completion`` — ``prompt`` and ``completion`` strings: the prompt (with the
  tokenizer's leading specials such as bos) is context only, the completion and a closing eos
  are targets. Nothing is inserted between the two: a separator belongs in the data;
* ``chat`` — a ``messages`` list of ``{"role", "content"}`` rendered by the tokenizer's chat
  template (`lctrain.data.chat`); the assistant turns are targets;
* ``tokenized`` — ``input_ids`` as given (nothing added) and optional ``labels`` in the
  transformers convention (unshifted: each label equals its input id, or -100 for no loss).

``auto`` detects the format from the first record's fields: ``input_ids`` → tokenized,
``messages`` → chat, ``prompt`` and ``completion`` → prompt_completion, ``data.text_field`` →
text. Later records must have the same shape.

Bad records are errors naming the record (a field missing, a value of the wrong type, an id
outside the vocabulary, a chat message without a string role and content). Records that hold
nothing to train on — an empty document, an empty completion, a conversation without an
assistant turn or whose assistant replies are all empty strings, labels that are all -100 — are
skipped and counted (`Skips`), with the first one's location, for the banner. The rule is the
record's: a conversation with some non-empty reply is kept whole, as its template renders it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from lctrain.data.chat import check_chat_tokenizer, check_messages, encode_chat
from lctrain.data.records import Record
from lctrain.data.tokenizer import ByteTokenizer, encode_documents
from lctrain.errors import DataError

FORMATS = ("text", "prompt_completion", "chat", "tokenized")
"""The formats a record can have (``data.format`` also takes ``auto``)."""

MASKED_FORMATS = ("prompt_completion", "chat")
"""Formats whose samples carry a loss mask by construction (tokenized ones may, with labels)."""


@dataclass(frozen=True)
class Sample:
    """One sample: token ids and the per-token target flags."""

    ids: np.ndarray
    """(n,) int32 token ids."""
    targets: np.ndarray
    """(n,) bool: token t is trained on (predicted from tokens < t)."""
    where: str
    """The record it came from."""


@dataclass
class Skips:
    """Records left out because they hold nothing to train on: reason -> (count, first where)."""

    reasons: dict[str, list] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        entry = self.reasons.setdefault(reason, [0, where])
        entry[0] += 1

    @property
    def total(self) -> int:
        return sum(count for count, _ in self.reasons.values())

    def describe(self) -> str:
        """``"3 skipped (empty document: 3, first at a.jsonl:7)"``, or "" when none."""
        if not self.reasons:
            return ""
        parts = [f"{reason}: {count}, first at {where}"
                 for reason, (count, where) in self.reasons.items()]
        return f"{self.total} skipped ({'; '.join(parts)})"


def detect_format(record: Record, text_field: str) -> tuple[str, str]:
    """The format of ``record`` from its fields, and why (for the banner).

    Raises:
        DataError: no known field is present.
    """
    fields = record.fields
    if "input_ids" in fields:
        return "tokenized", "records have input_ids"
    if "messages" in fields:
        return "chat", "records have a messages list"
    if "prompt" in fields and "completion" in fields:
        return "prompt_completion", "records have prompt and completion"
    if text_field in fields:
        return "text", f"records have a {text_field!r} field"
    raise DataError(f"{record.where} has fields {sorted(fields)}, none of which says its format "
                    f"(text in {text_field!r}, prompt + completion, messages, input_ids); set "
                    f"data.text_field to the text's field or data.format")


class Encoder:
    """Turns records of one format into samples with one tokenizer.

    Args:
        fmt: one of FORMATS.
        tokenizer: ByteTokenizer or a transformers tokenizer.
        text_field: the text format's field.

    Raises:
        DataError: the chat format with a tokenizer that has no chat template.
    """

    def __init__(self, fmt: str, tokenizer: Any, text_field: str) -> None:
        self.fmt, self.tokenizer, self.text_field = fmt, tokenizer, text_field
        self.skips = Skips()
        self.has_labels = False  # tokenized records with a labels field were seen
        if fmt == "chat":
            check_chat_tokenizer(tokenizer)
        if fmt == "prompt_completion":
            self._prefix = leading_specials(tokenizer)

    def encode(self, records: Sequence[Record]) -> list[Sample]:
        """The samples of ``records`` (a batch, so fast tokenizers run batched); records with
        nothing to train on are counted in ``self.skips`` and left out.

        Raises:
            DataError: a record lacks a field or has a value of the wrong type.
        """
        method = {"text": self._text, "prompt_completion": self._prompt_completion,
                  "chat": self._chat, "tokenized": self._tokenized}[self.fmt]
        samples = method(records)
        kept = []
        for sample in samples:
            if sample is not None and not sample.targets.any():
                self.skips.add("no target token", sample.where)
            elif sample is not None:
                kept.append(sample)
        return kept

    def _text(self, records: Sequence[Record]) -> list[Sample | None]:
        texts, wheres = [], []
        for record in records:
            text = _string(record, self.text_field, f"data.text_field {self.text_field!r}")
            if text:
                texts.append(text)
                wheres.append(record.where)
            else:
                self.skips.add("empty document", record.where)
        docs = encode_documents(self.tokenizer, texts) if texts else []
        return [Sample(_ids(doc), np.ones(len(doc), bool), where) for doc, where in zip(docs, wheres)]

    def _prompt_completion(self, records: Sequence[Record]) -> list[Sample | None]:
        prompts, completions, wheres = [], [], []
        for record in records:
            prompt = _string(record, "prompt", "'prompt'")
            completion = _string(record, "completion", "'completion'")
            if not completion:
                self.skips.add("empty completion", record.where)
                continue
            prompts.append(prompt or "")
            completions.append(completion)
            wheres.append(record.where)
        if not wheres:
            return []
        eos = self.tokenizer.eos_token_id
        samples = []
        for p, c, where in zip(plain_ids(self.tokenizer, prompts),
                               plain_ids(self.tokenizer, completions), wheres):
            head, tail = self._prefix + p, c + ([] if eos is None else [eos])
            samples.append(Sample(_ids(head + tail), np.array([False] * len(head) + [True] * len(tail)),
                                  where))
        return samples

    def _chat(self, records: Sequence[Record]) -> list[Sample | None]:
        samples: list[Sample | None] = []
        for record in records:
            messages = record.fields.get("messages")
            if not isinstance(messages, list):
                raise DataError(f"{record.where}: messages must be a list of {{role, content}} "
                                f"objects, got {_kind(messages)}")
            if not messages:
                self.skips.add("empty conversation", record.where)
                continue
            check_messages(messages, record.where)
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            if not replies:
                self.skips.add("no assistant turn", record.where)
                continue
            if not any(replies):
                self.skips.add("empty assistant reply", record.where)
                continue
            ids, mask = encode_chat(self.tokenizer, messages, record.where)
            samples.append(Sample(_ids(ids), np.asarray(mask, dtype=bool), record.where))
        return samples

    def _tokenized(self, records: Sequence[Record]) -> list[Sample | None]:
        return [self._one_tokenized(record) for record in records]

    def _one_tokenized(self, record: Record) -> Sample | None:
        ids = _int_array(record, "input_ids")
        if ids.size == 0:
            self.skips.add("empty input_ids", record.where)
            return None
        limit = len(self.tokenizer)
        bad = (ids < 0) | (ids >= limit)
        if bad.any():
            raise DataError(f"{record.where}: input_ids holds {int(ids[bad][0])}, outside the "
                            f"tokenizer's vocabulary of {limit} ids; tokenize with data.tokenizer")
        if record.fields.get("labels") is None:
            return Sample(ids.astype(np.int32), np.ones(ids.size, bool), record.where)
        self.has_labels = True
        labels = _int_array(record, "labels")
        if labels.shape != ids.shape:
            raise DataError(f"{record.where}: labels has {labels.size} entries but input_ids "
                            f"{ids.size}; give one label per input id")
        targets = labels != -100
        if np.any(labels[targets] != ids[targets]):
            i = int(np.flatnonzero(targets & (labels != ids))[0])
            raise DataError(f"{record.where}: labels[{i}] is {int(labels[i])} but input_ids[{i}] "
                            f"is {int(ids[i])}; labels must be the input ids (unshifted, as "
                            f"transformers models take them) or -100 for no loss")
        return Sample(ids.astype(np.int32), targets, record.where)


def _string(record: Record, key: str, what: str) -> str | None:
    """The string field ``key`` (None and "" both mean empty), or a DataError."""
    if key not in record.fields:
        raise DataError(f"{record.where} has no {key!r} field (its fields are "
                        f"{sorted(record.fields)}); check data.format and data.text_field")
    value = record.fields[key]
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"{record.where}: {what} is {_kind(value)}, not a string; give "
                    f"text there, or set data.format to the records' format (chat for a "
                    f"messages list, tokenized for token ids)")


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _int_array(record: Record, key: str) -> np.ndarray:
    value = record.fields.get(key)
    array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise DataError(f"{record.where}: {key} must be a list of whole numbers, got "
                        f"{_kind(value)}")
    return array.astype(np.int64)


def _ids(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def plain_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text with no special token added."""
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def leading_specials(tokenizer: Any) -> list[int]:
    """The special ids the tokenizer puts before a text (bos for most), found by encoding a
    probe with and without special tokens."""
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.bos_token_id]
    probe = "lctrain"
    bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start]
    return []
