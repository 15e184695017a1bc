"""Records → samples: int32 token ids and, per token, whether it is a training target.

Formats: ``text`` (every token a target), ``prompt_completion`` (the completion and a closing eos;
Alpaca's instruction, input, output too), ``chat`` (the assistant turns of OpenAI ``messages`` or
ShareGPT ``conversations``) and ``tokenized`` (optional unshifted ``labels``); ``auto`` detects it
from the first record. Records with nothing to train on are skipped and counted. Chats render
through transformers' chat templates: the assistant's characters are those inside
``{% generation %}`` markers, or found by rendering prefixes; its tokens, those overlapping them."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from lctrain.data.chat_templates import resolve_template
from lctrain.data.records import Record
from lctrain.data.tokenizer import ByteTokenizer, encode_documents, encode_offsets
from lctrain.errors import DataError, first_line

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "function_call": "assistant",
                "observation": "tool", "function": "tool"}
"""ShareGPT's role names (LLaMA-Factory's tags) -> ours."""
NAMES = {name: name for name in ("text", "prompt", "completion", "instruction", "input", "output")}
"""Record fields by our name -> the records' name (data.fields changes them)."""


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

    def add(self, reason: str, where: str, count: int = 1) -> None:
        self.reasons.setdefault(reason, [0, where])[0] += count

    def describe(self) -> str:
        """``"3 skipped (empty document: 3, first at a.jsonl:7)"``, or ""."""
        if not self.reasons:
            return ""
        parts = [f"{reason}: {count}, first at {where}"
                 for reason, (count, where) in self.reasons.items()]
        return f"{sum(count for count, _ in self.reasons.values())} skipped ({'; '.join(parts)})"


def detect_format(record: Record, fields: dict | None = None) -> tuple[str, str]:
    """The format of ``record`` from its fields (named as ``data.fields`` maps them), and why;
    a DataError when no field says."""
    names, have = {**NAMES, **(fields or {})}, _present(record)
    if "input_ids" in have:
        return "tokenized", "records have input_ids"
    key = _list_key(have, fields)
    if key in have:
        first = have[key][0] if isinstance(have[key], list) and have[key] else {}
        sharegpt = isinstance(first, dict) and "from" in first and "role" not in first
        return "chat", f"records have {'a ShareGPT' if sharegpt else 'a'} {key} list"
    if names["prompt"] in have and names["completion"] in have:
        return "prompt_completion", "records have prompt and completion"
    if names["instruction"] in have and names["output"] in have:
        return "prompt_completion", "Alpaca records: instruction, input, output"
    if names["text"] in have:
        return "text", f"records have a {names['text']!r} field"
    nulls = sorted(k for k, v in record.fields.items() if v is None)
    null = f" ({', '.join(nulls)}: null)" if nulls else ""
    raise DataError(f"{record.where} has fields {sorted(have)}{null}, none of which says its "
                    f"format (text in {names['text']!r}, prompt + completion, instruction + "
                    f"output, messages or conversations, input_ids); map data.fields (e.g. "
                    f"data.fields.text) to the records' field names, or set data.format")


def _present(record: Record) -> dict[str, Any]:
    """The fields a record gives (not null: a field other records of its file have is null)."""
    return {k: v for k, v in record.fields.items() if v is not None}


def _list_key(have: dict, fields: dict | None) -> str:
    """The field holding a chat record's messages: data.fields' messages, else messages or
    (ShareGPT) conversations."""
    mapped = (fields or {}).get("messages")
    return mapped or ("conversations" if "conversations" in have and "messages" not in have
                      else "messages")


class Encoder:
    """Turns records of format ``fmt`` (text, prompt_completion, chat or tokenized) into samples
    with ``tokenizer``; ``fields``, ``turns``: data.fields and data.turns; ``template``:
    data.chat_template's Jinja, which also renders prompt/completion records as a user turn and
    an assistant turn; ``why``: why the format is ``fmt``."""

    def __init__(self, fmt: str, tokenizer: Any, *, fields: dict | None = None,
                 turns: str = "all", template: str | None = None, why: str = "data.format") -> None:
        self.fmt, self.tokenizer = fmt, tokenizer
        self.fields, self.names = fields, {**NAMES, **(fields or {})}
        self.last, self.skip_unanswered = turns.startswith("last"), turns.endswith("_or_skip")
        self.template, self.why, self.skips = template, why, Skips()
        self.has_labels = False  # tokenized records with a labels field were seen
        if fmt == "chat" or (fmt == "prompt_completion" and template):
            check_chat_tokenizer(tokenizer, template)
        if fmt == "prompt_completion":
            self._prefix = leading_specials(tokenizer)

    @classmethod
    def for_data(cls, data: Any, tokenizer: Any, first: Record) -> "Encoder":
        """The encoder of the DataConfig ``data``, its format (``.fmt``) and why (``.why``)
        detected from the ``first`` record where data.format is auto."""
        template = None if data.chat_template is None else resolve_template(data.chat_template)
        try:
            fmt, why = detect_format(first, data.fields)
        except DataError:
            if data.format == "auto":
                raise
            fmt, why = None, ""
        if data.format != "auto":  # named as given, with what the first record looks like
            fmt, why = data.format, "data.format" + (f"; {why}" if fmt == data.format else "")
        return cls(fmt, tokenizer, fields=data.fields, turns=data.turns, template=template, why=why)

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

    def _text(self, records: Sequence[Record]) -> list[Sample]:
        texts, wheres = [], []
        for record in records:
            text = _string(record, self.names["text"])
            if text:
                texts.append(text)
                wheres.append(record.where)
            else:
                self.skips.add("empty document", record.where)
        docs = encode_documents(self.tokenizer, texts) if texts else []
        return [Sample(_ids(doc), np.ones(len(doc), bool), where) for doc, where in zip(docs, wheres)]

    def _pair(self, record: Record) -> tuple[str, str | None]:
        """A prompt/completion or Alpaca record's prompt and completion."""
        def get(name: str) -> str | None:
            return _string(record, self.names[name])

        have = _present(record)
        if self.names["prompt"] in have or self.names["instruction"] not in have:
            return get("prompt") or "", get("completion")
        instruction = get("instruction") or ""
        extra = get("input") if self.names["input"] in have else None
        if self.template:
            prompt = f"{instruction}\n\n{extra}" if extra else instruction
        else:  # the Alpaca prompt (Stanford Alpaca's, as axolotl's alpaca type writes it)
            context = ", paired with an input that provides further context" if extra else ""
            prompt = (f"Below is an instruction that describes a task{context}. Write a response "
                      f"that appropriately completes the request.\n\n### Instruction:\n"
                      f"{instruction}\n\n" + (f"### Input:\n{extra}\n\n" if extra else "")
                      + "### Response:\n")
        return prompt, get("output")

    def _prompt_completion(self, records: Sequence[Record]) -> list[Sample]:
        prompts, completions, wheres = [], [], []
        for record in records:
            prompt, completion = self._pair(record)
            if not completion:
                self.skips.add("empty completion", record.where)
                continue
            prompts.append(prompt)
            completions.append(completion)
            wheres.append(record.where)
        if self.template:  # a user turn and an assistant turn
            return [self._chat_sample([{"role": "user", "content": p},
                                       {"role": "assistant", "content": c}], w, last=False)
                    for p, c, w in zip(prompts, completions, wheres)]
        if not wheres:
            return []
        eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        heads = [self._prefix + p for p in plain_ids(self.tokenizer, prompts)]
        return [Sample(_ids(h + c + eos), np.arange(len(h + c + eos)) >= len(h), where)
                for h, c, where in zip(heads, plain_ids(self.tokenizer, completions), wheres)]

    def _chat(self, records: Sequence[Record]) -> list[Sample]:
        samples = []
        for record in records:
            key = _list_key(_present(record), self.fields)
            messages = record.fields.get(key)
            if not isinstance(messages, list):
                raise DataError(f"{record.where}: {key} must be a list of messages ({{role, "
                                f"content}} or ShareGPT's {{from, value}}), got {_kind(messages)}")
            messages = chat_messages(messages, record.where, self.fields)
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            if not replies and not self.skip_unanswered:
                raise DataError(f"{record.where}: the conversation has no assistant turn, so "
                                f"nothing in it is trained on; add one, or set data.turns to "
                                f"all_or_skip (or last_or_skip) to skip such records")
            if not replies:
                self.skips.add("no assistant turn", record.where)
                continue
            if not any(replies[-1:] if self.last else replies):
                self.skips.add("empty assistant reply", record.where)
                continue
            samples.append(self._chat_sample(messages, record.where, last=self.last))
        return samples

    def _chat_sample(self, messages: list[dict], where: str, *, last: bool) -> Sample:
        ids, mask = encode_chat(self.tokenizer, messages, where, last=last, template=self.template)
        return Sample(_ids(ids), np.asarray(mask, bool), where)

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


def _string(record: Record, key: str) -> str | None:
    """The string field ``key`` (None and "" both mean empty), or a DataError."""
    if not record.gives(key):
        raise DataError(f"{record.where} has no {key!r} field (its fields are "
                        f"{sorted(_present(record))}); check data.format and data.fields")
    value = record.fields[key]
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"{record.where}: {key!r} is {_kind(value)}, not a string; give "
                    f"text there, or set data.format to the records' format (chat for a "
                    f"messages list, tokenized for token ids)")


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _whole(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())


def _int_array(record: Record, key: str) -> np.ndarray:
    value = record.fields.get(key)
    try:
        array = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray)) else None
    except ValueError:  # ragged lists in the list
        array = None
    if array is not None and array.dtype.kind == "f" and np.all(array == np.round(array)):
        array = array.astype(np.int64)  # whole numbers that share a column with fractions
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        odd = [v for v in value if not _whole(v)][:1] if isinstance(value, (list, tuple)) else []
        got = f"it holds {odd[0]!r}" if odd else f"got {_kind(value)}"
        raise DataError(f"{record.where}: {key} must be a list of whole numbers, but {got}")
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
    bare = list(tokenizer("lctrain", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("lctrain", add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start]
    return []


def check_chat_tokenizer(tokenizer: Any, template: str | None = None) -> None:
    """Raise a DataError unless ``tokenizer`` can render chats (with ``template``, else its own)."""
    if isinstance(tokenizer, ByteTokenizer):
        return
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if not (template or getattr(tokenizer, "chat_template", None)):
        raise DataError(f"data.format is chat but the tokenizer {name!r} has no chat template; set "
                        "data.chat_template (a name such as chatml or llama3, or a .jinja file), "
                        "give the tokenizer one (a chat_template.jinja file in its folder), or "
                        "give the records as prompt and completion (data.format=prompt_completion)")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"data.format is chat but the tokenizer {name!r} is not a fast (Rust) "
                        f"tokenizer, whose character offsets locate the assistant's tokens; use "
                        f"a tokenizer folder with a tokenizer.json")


def chat_messages(messages: Sequence[Any], where: str, fields: dict | None = None) -> list[dict]:
    """The messages as ``{role, content, ...}`` with our role names (from ShareGPT's
    ``{from, value}`` and the names ``fields`` maps); DataError naming ``where`` unless every
    message has a known role and a string content (missing or null is malformed, "" allowed)."""
    fields = fields or {}
    roles = {**ROLE_ALIASES, **{r: r for r in ROLES}, **{fields[r]: r for r in ROLES if r in fields}}
    out = []
    for i, message in enumerate(messages):
        sharegpt = isinstance(message, dict) and "from" in message and "role" not in message
        role_key = fields.get("role", "from" if sharegpt else "role")
        content_key = fields.get("content", "value" if sharegpt else "content")
        if not isinstance(message, dict) or not isinstance(message.get(role_key), str):
            raise DataError(f"{where}: each message must be an object with a string role, got "
                            f"{message!r:.80}")
        role = message[role_key]
        if role not in roles:
            raise DataError(f"{where}: message {i} has role {role!r}, which is none of "
                            f"{', '.join(ROLES)} (nor ShareGPT's {', '.join(ROLE_ALIASES)}); "
                            f"correct the record, or map the role with data.fields (such as "
                            f"data.fields.user={role})")
        content = message.get(content_key)
        if not isinstance(content, str):
            kind = "null" if content is None else f"of type {type(content).__name__}"
            kind = f"content {kind}, not a string" if content_key in message else "no content"
            raise DataError(f"{where}: message {i} ({role}) has {kind}; each message must be an "
                            "object with a string role and a string content")
        out.append({**{k: v for k, v in message.items() if k not in (role_key, content_key)
                       and v is not None}, "role": roles[role], "content": content})
    return out


def encode_chat(tokenizer: Any, messages: Sequence[dict], where: str, *, last: bool = False,
                template: str | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation and, per token, whether it is the assistant's (``last``: of
    the last assistant turn only), rendered with ``template`` or the tokenizer's chat template
    (the bytes tokenizer without one: its own format); DataError (naming ``where``) when a
    message is malformed or the template fails on the conversation."""
    messages = chat_messages(messages, where)
    template = template or tokenizer.chat_template
    if not template:  # the bytes tokenizer's own format, a prefix of which is each turn's
        check_chat_tokenizer(tokenizer)
        ids, mask = tokenizer.encode_chat(messages)
        if last:
            k = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            head = len(tokenizer.encode_chat(messages[:k], add_generation_prompt=True)[0])
            mask = [False] * head + mask[head:]
        return ids, mask
    try:
        if _GENERATION.search(template):
            from transformers.utils.chat_template_utils import render_jinja_template

            (text,), (spans,) = render_jinja_template(
                [messages], chat_template=template, return_assistant_tokens_mask=True,
                **tokenizer.special_tokens_map)
        else:
            text, spans = assistant_spans(tokenizer, messages, where, template)
        ids, offsets = encode_offsets(tokenizer, text)
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 - jinja2 errors, raise_exception in templates
        raise DataError(f"{where}: the chat template cannot render this conversation "
                        f"({first_line(error)}); fix the record or the template") from None
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in spans[-1:] if last else spans:  # as transformers: a token overlapping the span
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    return ids, mask.tolist()


def assistant_spans(tokenizer: Any, messages: Sequence[dict], where: str, template: str
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's rendered text and the character spans of its assistant turns, for a
    template without ``{% generation %}`` markers: the characters between the rendering of
    ``messages[:i]`` with the generation prompt and that of ``messages[:i + 1]`` are message i's."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(part, prompt):  # as apply_chat_template, which the bytes tokenizer lacks
        (text,), _ = render_jinja_template([list(part)], chat_template=template,
                                           add_generation_prompt=prompt,
                                           **tokenizer.special_tokens_map)
        return text

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or (not i and message["content"] == ""):
            continue  # an empty opening reply has no content to find: none of it is trained on
        through, content = render(messages[:i + 1], False), message["content"].strip()
        if i:  # where the generation prompt after the messages before it ends (-1: not there)
            before = render(messages[:i], True)
            start = len(before) if text.startswith(before) and len(through) >= len(before) else -1
        else:  # an opening reply: where its content starts (-1: the template changed it)
            start = through.find(content) if content else -1
        if start < 0 or not text.startswith(through):
            raise DataError(f"{where}: the chat template renders the conversation up to message "
                            f"{i} differently from the whole conversation, so the assistant's "
                            f"tokens cannot be found; use a template with {{% generation %}} "
                            f"markers around the assistant's replies")
        end = len(through.rstrip())
        if end > start:
            spans.append((start, end))
    return text, spans

