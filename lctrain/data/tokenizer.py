"""Tokenizers: a byte-level one that needs no download, or any transformers tokenizer.

The byte tokenizer maps a text to its UTF-8 bytes (ids 0–255) and adds three specials: bos (256),
eos (257) and pad (258), so ``vocab_size`` is 259. It works offline everywhere, which is what the
embedded default recipe and the random-init recipes need. It has a small chat format of its own
(`ByteTokenizer.encode_chat`) for chat data.
"""
from __future__ import annotations

from typing import Any, Sequence

from lctrain.config import BYTE_TOKENIZER_VOCAB, RecipeConfig
from lctrain.errors import DataError


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0–255 are byte values, then bos, eos and pad."""

    name_or_path = "bytes"
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = BYTE_TOKENIZER_VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``: ``[bos, *utf8_bytes, eos]`` (without bos/eos if asked)."""
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids, self.eos_token_id] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; specials are dropped (or shown as <bos>/<eos>/<pad>), bad UTF-8 replaced."""
        names = {self.bos_token_id: "<bos>", self.eos_token_id: "<eos>", self.pad_token_id: "<pad>"}
        out, run = [], bytearray()
        for token in (int(i) for i in ids):
            if token < 256:
                run.append(token)
                continue
            if token not in names:
                raise ValueError(f"token id {token} is outside the byte vocabulary (0–{self.vocab_size - 1})")
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(names[token])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False
                    ) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation in the byte tokenizer's own chat format, and which of
        them are the assistant's (the tokens a chat fine-tune trains on).

        The format: ``<bos>``, then per message ``<|ROLE|>`` + newline + content, ended by
        ``<eos>`` for the assistant and by a newline for any other role; with
        ``add_generation_prompt`` a final ``<|assistant|>`` + newline opens the reply. The
        assistant's content and its ``<eos>`` are marked True, headers and other turns False.

        Raises:
            ValueError: a message is not a mapping with a string ``role`` and ``content``.
        """
        ids, assistant = [self.bos_token_id], [False]
        for message in messages:
            role, content = (message.get("role"), message.get("content")) if isinstance(
                message, dict) else (None, None)
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(f"a message needs a string role and content, got {message!r}")
            header = self.encode(f"<|{role}|>\n", add_special_tokens=False)
            body = self.encode(content, add_special_tokens=False)
            end = [self.eos_token_id] if role == "assistant" else self.encode("\n", False)
            ids += header + body + end
            assistant += [False] * len(header) + [role == "assistant"] * (len(body) + len(end))
        if add_generation_prompt:
            header = self.encode("<|assistant|>\n", add_special_tokens=False)
            ids, assistant = ids + header, assistant + [False] * len(header)
        return ids, assistant

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


def load_tokenizer(cfg: RecipeConfig) -> Any:
    """The recipe's tokenizer: ByteTokenizer for ``bytes``, else a transformers AutoTokenizer.

    ``data.tokenizer: null`` loads the tokenizer stored with ``model.path``.

    Raises:
        DataError: the tokenizer folder / hub name cannot be loaded (missing, or offline).
    """
    name = cfg.data.tokenizer
    if name == "bytes":
        return ByteTokenizer()
    name = name or cfg.model.path
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"could not load the tokenizer {name!r} ({reason}); point data.tokenizer "
                        f"at a local tokenizer folder, or use data.tokenizer=bytes") from None


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each document, ending in the tokenizer's eos (the packed boundary marker)."""
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.encode(text) for text in texts]
    ids = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    if eos is None:
        return [list(doc) for doc in ids]
    return [list(doc) if doc and doc[-1] == eos else [*doc, eos] for doc in ids]


def pad_token_id(tokenizer: Any) -> int:
    """The id written into padding (never a label, never attended to by real tokens)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0
