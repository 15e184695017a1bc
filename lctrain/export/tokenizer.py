"""The tokenizer an export carries: the run's own, saved with ``save_pretrained``.

A run that used a transformers tokenizer (the model folder's, or ``data.tokenizer``) exports
that tokenizer's files unchanged. lctrain's built-in byte tokenizer exists only inside lctrain,
so an export of such a run carries an equivalent built with the ``tokenizers`` library and
wrapped as a transformers ``PreTrainedTokenizerFast`` — loadable by ``AutoTokenizer`` with no
lctrain installed:

- text → its UTF-8 bytes → ids 0–255 (GPT-2's byte-to-character map turns each byte into one
  character, and a BPE model with those 256 characters as its vocabulary and no merges maps each
  character to the byte's value);
- ``<bos>`` (256) before every text, as Llama's tokenizers do, so a prompt can be continued;
  ``<eos>`` is 257 and ``<pad>`` 258. A training document is the text and then ``<eos>``
  (`lctrain.data.tokenizer.encode_documents` appends it): exactly the byte tokenizer's ids;
- those three names in a text are bytes like any other, never the special ids
  (``split_special_tokens``), exactly as `lctrain.data.tokenizer.ByteTokenizer` treats them;
- decoding joins the bytes and replaces invalid UTF-8 with U+FFFD.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lctrain.config import RecipeConfig

BYTE_SPECIALS = {"<bos>": 256, "<eos>": 257, "<pad>": 258}
"""The byte tokenizer's special tokens and their ids (see `lctrain.data.tokenizer`)."""


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_fast():
    """A transformers ``PreTrainedTokenizerFast`` equivalent to ``ByteTokenizer`` (see above).

    Returns:
        The tokenizer (vocabulary 259: bytes, then ``<bos>``, ``<eos>``, ``<pad>``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {char: b for b, char in byte_to_char().items()}
    vocab.update(BYTE_SPECIALS)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B",
        special_tokens=[("<bos>", BYTE_SPECIALS["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        split_special_tokens=True, clean_up_tokenization_spaces=False,
        model_max_length=int(1e30))


def run_tokenizer(cfg: RecipeConfig) -> tuple[Any, bool]:
    """The tokenizer the run trained with, as a transformers tokenizer.

    Returns:
        (tokenizer, whether it stands in for lctrain's byte tokenizer); the tokenizer is None
        for ``byte-pairs``, the benchmark twins' tokenizer, which no transformers tokenizer
        reproduces: such an export holds no tokenizer files.

    Raises:
        DataError: the run's tokenizer folder or hub name cannot be loaded any more.
    """
    from lctrain.data import BytePairTokenizer, ByteTokenizer
    from lctrain.model import load_tokenizer

    tokenizer = load_tokenizer(cfg)
    if isinstance(tokenizer, BytePairTokenizer):
        return None, False
    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer_fast(), True
    return tokenizer, False


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Write ``tokenizer``'s files into ``folder`` (nothing for None: see `run_tokenizer`)."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


def align_special_ids(model_config: Any, generation_config: Any | None) -> None:
    """Point a model config's bos/eos/pad ids at the byte tokenizer's specials.

    A random-init config keeps its family's defaults (Llama: bos 1, eos 2), which mean other
    bytes to the byte tokenizer; generation would then never stop at ``<eos>``. The generation
    config follows when it was derived from the model config (the source had none).
    """
    model_config.bos_token_id = BYTE_SPECIALS["<bos>"]
    model_config.eos_token_id = BYTE_SPECIALS["<eos>"]
    model_config.pad_token_id = BYTE_SPECIALS["<pad>"]
    if generation_config is not None and getattr(generation_config, "_from_model_config", False):
        generation_config.bos_token_id = BYTE_SPECIALS["<bos>"]
        generation_config.eos_token_id = BYTE_SPECIALS["<eos>"]
        generation_config.pad_token_id = BYTE_SPECIALS["<pad>"]
