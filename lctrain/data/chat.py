"""Chat records → token ids and the assistant-token mask (what a chat fine-tune trains on).

Three ways, chosen by the tokenizer:

1. **The byte tokenizer** has a small format of its own (`ByteTokenizer.encode_chat`), which
   returns the mask directly.
2. **A chat template with ``{% generation %}`` markers** (the transformers convention for
   "these characters are the assistant's"): ``apply_chat_template(...,
   return_assistant_tokens_mask=True)`` gives the ids and the mask.
3. **Any other chat template**: prefix rendering. For the assistant message at index i, the text
   of ``messages[:i]`` with the generation prompt (the header that opens a reply) and the text of
   ``messages[:i + 1]`` must both be prefixes of the whole conversation's text; the characters
   between them — the reply and its end-of-turn marker, trailing whitespace excepted — are the
   assistant's (for a reply that opens the conversation, from its content on). The whole text
   is tokenized once and a token is the assistant's when its first character is (the character
   offsets of fast tokenizers). A template that renders an earlier part of the conversation
   differently from the whole (some drop the reasoning of earlier turns) cannot be handled this
   way and is an error naming the record: add ``{% generation %}`` markers to it.

A tokenizer without a chat template, or without character offsets (not a fast tokenizer), is an
error before the first conversation is encoded.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from lctrain.data.tokenizer import ByteTokenizer
from lctrain.errors import DataError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


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
    """Raise a DataError unless every message is an object with a string role and a string
    content (an empty string is allowed: whether an empty reply is trained on is the caller's
    rule). A missing or null content is a malformed record, not an empty one: templates would
    render it as nothing and the record would train on its end-of-turn marker alone.
    """
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
    """Token ids of a conversation and, per token, whether it is the assistant's.

    Args:
        tokenizer: ByteTokenizer or a transformers tokenizer with a chat template.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        where: the record's location, for messages.

    Raises:
        DataError: a malformed message (`check_messages`), a template that fails on the
            conversation, or one whose partial renderings are not prefixes of the whole.
    """
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
        return _by_prefixes(tokenizer, messages, where)
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 - jinja2 errors, raise_exception in templates
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"{where}: the chat template cannot render this conversation ({text}); "
                        f"fix the record or the template") from None


def assistant_spans(tokenizer: Any, messages: Sequence[dict], where: str
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's rendered text and the character spans of its assistant turns.

    Raises:
        DataError: a partial rendering is not a prefix of the whole conversation's.
    """
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
        else:
            start = _opening_reply(through, message)
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


def _opening_reply(through: str, message: dict) -> int:
    """Where an assistant message that opens the conversation starts in its rendering (there
    is no earlier part to render with a generation prompt): its content's first occurrence
    after any leading specials, or -1 when the template changed the content."""
    content = message.get("content")
    return through.find(content.strip()) if isinstance(content, str) and content.strip() else -1


def _by_prefixes(tokenizer: Any, messages: Sequence[dict], where: str) -> tuple[list[int], list[bool]]:
    text, spans = assistant_spans(tokenizer, messages, where)
    out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.array([start for start, _ in out["offset_mapping"]], dtype=np.int64)  # (n,)
    mask = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return list(out["input_ids"]), mask.tolist()
