"""Tokenizers (``data.tokenizer``): the model's own (null), any transformers tokenizer, or a
built-in one for random inits: ``bytes`` (UTF-8 bytes, then bos, eos, pad) and ``byte-pairs`` (two
bytes a token, a vocabulary as large as real ones', for benchmark twins).

A document is what the tokenizer's ``add_special_tokens=True`` makes of it, ending in eos."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from lctrain.config import (BYTE_PAIR_TOKENIZER_VOCAB, BYTE_TOKENIZER_VOCAB, RecipeConfig,
                            require_model_path)
from lctrain.config.hub import cache_only, check_hub_model, looks_like_hub_name
from lctrain.data.chat_templates import resolve_template
from lctrain.errors import ConfigError, DataError, first_line


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0–255 are byte values, then bos, eos and pad."""

    name_or_path = "bytes"
    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = BYTE_TOKENIZER_VOCAB
    chat_template: str | None = None  # data.chat_template; None: the chat format below
    special_tokens_map = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    _width = 1  # bytes a token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``: ``[bos, *tokens, eos]`` (without bos/eos if asked)."""
        ids = self._encode_bytes(text.encode("utf-8"))
        return [self.bos_token_id, *ids, self.eos_token_id] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; specials dropped (or shown as <bos>/<eos>/<pad>), bad UTF-8 replaced."""
        names = {self.bos_token_id: "<bos>", self.eos_token_id: "<eos>", self.pad_token_id: "<pad>"}
        out, run = [], bytearray()
        for token in (int(i) for i in ids):
            if token < self.bos_token_id:
                run += self._token_bytes(token)
                continue
            if token not in names:
                raise ValueError(f"token id {token} is outside the {self.name_or_path} vocabulary "
                                 f"(0–{self.vocab_size - 1})")
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(names[token])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False
                    ) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation and which of them are the assistant's: ``<bos>``, then
        per message ``<|ROLE|>\\n`` + content + (``<eos>`` for the assistant, else ``\\n``);
        ``add_generation_prompt`` appends ``<|assistant|>\\n``."""
        ids, assistant = [self.bos_token_id], [False]
        for message in messages:
            role, content = message["role"], message["content"]
            header = self.encode(f"<|{role}|>\n", add_special_tokens=False)
            body = self.encode(content, add_special_tokens=False)
            end = [self.eos_token_id] if role == "assistant" else self.encode("\n", False)
            ids += header + body + end
            assistant += [False] * len(header) + [role == "assistant"] * (len(body) + len(end))
        if add_generation_prompt:
            header = self.encode("<|assistant|>\n", add_special_tokens=False)
            ids, assistant = ids + header, assistant + [False] * len(header)
        return ids, assistant

    def _encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def _token_bytes(self, token: int) -> bytes:
        return bytes((token,))

    def __len__(self) -> int:
        return self.vocab_size


class BytePairTokenizer(ByteTokenizer):
    """Two UTF-8 bytes a token (id 256·b0 + b1); a lone last byte is 65,536 + b; then specials."""

    name_or_path = "byte-pairs"
    _LONE = 1 << 16
    bos_token_id = _LONE + 256
    eos_token_id = _LONE + 257
    pad_token_id = _LONE + 258
    vocab_size = BYTE_PAIR_TOKENIZER_VOCAB
    _width = 2

    def _encode_bytes(self, data: bytes) -> list[int]:
        raw = np.frombuffer(data, dtype=np.uint8).astype(np.int64)  # (n,)
        even = raw.shape[0] // 2 * 2
        ids = raw[:even:2] * 256 + raw[1:even:2]  # (n // 2,)
        tail = [self._LONE + int(raw[-1])] if raw.shape[0] % 2 else []
        return [*ids.tolist(), *tail]

    def _token_bytes(self, token: int) -> bytes:
        return bytes((token - self._LONE,)) if token >= self._LONE else bytes(divmod(token, 256))


BUILTIN = {"bytes": ByteTokenizer, "byte-pairs": BytePairTokenizer}


def load_tokenizer(cfg: RecipeConfig, vocab_size: int | None = None) -> Any:
    """The recipe's tokenizer, checked against the model's ``vocab_size`` when given
    (ConfigError: more ids than the model has embeddings; DataError: it cannot be loaded)."""
    tokenizer = _load(cfg, vocab_size)
    if cfg.data.chat_template is not None:  # saved with the tokenizer by an export
        tokenizer.chat_template = resolve_template(cfg.data.chat_template)
    return tokenizer


def _load(cfg: RecipeConfig, vocab_size: int | None) -> Any:
    name = cfg.data.tokenizer
    if name in BUILTIN:
        return BUILTIN[name]()
    if name is not None and not os.path.exists(os.path.expanduser(name)) \
            and looks_like_hub_name(name):  # model.path's hub name was checked with the recipe
        check_hub_model(name, what="data.tokenizer", subject="the tokenizer", local="tokenizer",
                        files=("tokenizer_config.json", "tokenizer.json", "config.json"))
    source = name or require_model_path(cfg.model.path)
    from transformers import AutoTokenizer

    try:  # a hub name comes from the local hub cache at once when the hub cannot be asked
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=cache_only(source),
                                                  trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as error:
        where = "the tokenizer" if name else "the tokenizer of model.path"
        raise DataError(f"could not load {where} {source!r} ({first_line(error)}); point "
                        f"data.tokenizer at a local tokenizer folder") from None
    if vocab_size is not None and len(tokenizer) > vocab_size:  # ids without an embedding
        shown, vocab = cfg.data.tokenizer or cfg.model.path, vocab_size
        raise ConfigError(f"the tokenizer {shown!r} has {len(tokenizer)} tokens but the model's "
                          f"vocab_size is {vocab}, so ids {vocab} and up have no embedding; use "
                          f"the model's own tokenizer (data.tokenizer=null) or one that matches it",
                          key="data.tokenizer")
    return tokenizer


def encode_documents(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each document, with the tokenizer's specials and a closing eos."""
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.encode(text) for text in texts]
    ids = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    return [list(doc) if eos is None or (doc and doc[-1] == eos) else [*doc, eos] for doc in ids]


def encode_offsets(tokenizer: Any, text: str) -> tuple[list[int], np.ndarray]:
    """Token ids of ``text`` (no special token added) and each token's (start, end) characters
    as an (n, 2) array; a built-in tokenizer's token spans the characters of its bytes."""
    if not isinstance(tokenizer, ByteTokenizer):
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(out["input_ids"]), np.asarray(out["offset_mapping"], np.int64).reshape(-1, 2)
    data = text.encode("utf-8")
    raw = np.frombuffer(data, dtype=np.uint8)
    char = np.cumsum((raw & 0xC0) != 0x80) - 1  # (bytes,) the character each byte belongs to
    first = np.arange(0, raw.size, tokenizer._width)  # (n,) each token's first byte
    last = np.minimum(first + tokenizer._width, raw.size) - 1
    return tokenizer._encode_bytes(data), np.stack([char[first], char[last] + 1], axis=1)


def pad_token_id(tokenizer: Any) -> int:
    """The id written into padding (never a label)."""
    ids = (tokenizer.pad_token_id, tokenizer.eos_token_id)
    return int(next((i for i in ids if i is not None), 0))
