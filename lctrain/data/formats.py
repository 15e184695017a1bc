"""Records → samples: int32 token ids and, per token, whether it is a training target.

Formats: ``text`` (every token a target), ``prompt_completion`` (the completion and a closing eos),
``chat`` (the assistant turns) and ``tokenized`` (optional unshifted ``labels``); ``auto`` detects
it from the first record. Records with nothing to train on are skipped and counted. A chat template
without ``{% generation %}`` markers is rendered by prefixes: the characters between the rendering
of ``messages[:i]`` with the generation prompt and that of ``messages[:i + 1]`` are assistant
message i's."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from lctrain.data.records import Record
from lctrain.data.tokenizer import ByteTokenizer, encode_documents
from lctrain.errors import DataError

FORMATS = ("text", "prompt_completion", "chat", "tokenized")  # data.format also takes auto
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Sample:
    """One sample: (n,) int32 ``ids``, (n,) bool ``targets`` and the record's location."""

    ids: np.ndarray
    targets: np.ndarray
    where: str


@dataclass
class Skips:
    """Records left out because they hold nothing to train on: reason -> (count, first where)."""

    reasons: dict[str, list] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.reasons.setdefault(reason, [0, where])[0] += 1

    def describe(self) -> str:
        """``"3 skipped (empty document: 3, first at a.jsonl:7)"``, or ""."""
        if not self.reasons:
            return ""
        parts = [f"{reason}: {count}, first at {where}"
                 for reason, (count, where) in self.reasons.items()]
        total = sum(count for count, _ in self.reasons.values())
        return f"{total} skipped ({'; '.join(parts)})"


def detect_format(record: Record, text_field: str) -> tuple[str, str]:
    """The format of ``record`` from its fields, and why; a DataError when no field says."""
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
    """Turns records of format ``fmt`` (one of FORMATS) into samples with ``tokenizer``."""

    def __init__(self, fmt: str, tokenizer: Any, text_field: str) -> None:
        self.fmt, self.tokenizer, self.text_field = fmt, tokenizer, text_field
        self.skips = Skips()
        self.has_labels = False  # tokenized records with a labels field were seen
        if fmt == "chat":
            check_chat_tokenizer(tokenizer)
        if fmt == "prompt_completion":
            self._prefix = leading_specials(tokenizer)

    def encode(self, records: Sequence[Record]) -> list[Sample]:
        """The samples of ``records`` (batched for fast tokenizers); records with nothing to
        train on are counted in ``self.skips``; a DataError names a missing or mistyped field."""
        kept = []
        for sample in filter(None, getattr(self, "_" + self.fmt)(records)):
            if sample.targets.any():
                kept.append(sample)
            else:
                self.skips.add("no target token", sample.where)
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
    """The special ids the tokenizer puts before a text (bos for most)."""
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.bos_token_id]
    probe = "lctrain"
    bare = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start]
    return []


def check_chat_tokenizer(tokenizer: Any) -> None:
    """Raise a DataError unless ``tokenizer`` can render chats."""
    if isinstance(tokenizer, ByteTokenizer):
        return
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"data.format is chat but the tokenizer {name!r} has no chat template; "
                        f"give it one (a chat_template.jinja file in its folder, or a "
                        f"\"chat_template\" entry in its tokenizer_config.json), use a tokenizer "
                        f"folder that has one (data.tokenizer; for a random init also "
                        f"data.tokenizer=bytes, whose own chat format needs none), or give the "
                        f"records as prompt and completion (data.format=prompt_completion)")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"data.format is chat but the tokenizer {name!r} is not a fast (Rust) "
                        f"tokenizer, whose character offsets locate the assistant's tokens; use "
                        f"a tokenizer folder with a tokenizer.json")


def check_messages(messages: Sequence[Any], where: str) -> None:
    """Raise a DataError unless every message has a string role and a string content (a
    missing or null content is malformed; an empty string is allowed)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"{where}: each message must be an object with a string role, got "
                            f"{message!r:.80}")
        if "content" not in message:
            raise DataError(f"{where}: message {i} ({message['role']}) has no content; each "
                            f"message must be an object with a string role and a string content")
        content = message["content"]
        if not isinstance(content, str):
            kind = "null" if content is None else f"of type {type(content).__name__}"
            raise DataError(f"{where}: message {i} ({message['role']}) has content {kind}, not "
                            f"a string; each message must be an object with a string role and "
                            f"a string content")


def encode_chat(tokenizer: Any, messages: Sequence[dict], where: str) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and, per token, whether it is the assistant's; DataError
    (naming ``where``) when a message is malformed or the template fails on the conversation."""
    check_messages(messages, where)
    if isinstance(tokenizer, ByteTokenizer):
        try:
            return tokenizer.encode_chat(messages)
        except ValueError as error:
            raise DataError(f"{where}: {error}; the bytes tokenizer's chat format needs text "
                            f"content") from None
    try:
        if _GENERATION.search(tokenizer.chat_template):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        text, spans = assistant_spans(tokenizer, messages, where)
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.array([start for start, _ in out["offset_mapping"]], dtype=np.int64)  # (n,)
        mask = np.zeros(len(starts), dtype=bool)
        for a, b in spans:  # a token is the assistant's when its first character is
            mask |= (starts >= a) & (starts < b)
        return list(out["input_ids"]), mask.tolist()
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 - jinja2 errors, raise_exception in templates
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{where}: the chat template cannot render this conversation ({text}); "
                        f"fix the record or the template") from None


def assistant_spans(tokenizer: Any, messages: Sequence[dict], where: str
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's rendered text and the character spans of its assistant turns."""
    def render(part, prompt):
        return tokenizer.apply_chat_template(list(part), tokenize=False,
                                             add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if not i and message["content"] == "":
            continue  # an empty opening reply: no content to find, nothing of it is trained on
        through = render(messages[:i + 1], False)
        if i:
            before = render(messages[:i], True)
            start = len(before)
            ok = text.startswith(before) and text.startswith(through) and len(through) >= start
        else:  # an opening reply: where its content starts (-1: the template changed it)
            content = message["content"].strip()
            start = through.find(content) if content else -1
            ok = text.startswith(through) and start >= 0
        if not ok:
            raise DataError(f"{where}: the chat template renders the conversation up to message "
                            f"{i} differently from the whole conversation, so the assistant's "
                            f"tokens cannot be found; use a template with {{% generation %}} "
                            f"markers around the assistant's replies")
        end = len(through.rstrip())
        if end > start:
            spans.append((start, end))
    return text, spans

