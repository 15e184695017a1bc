"""Tiny Hugging Face model folders of real families, built offline, for tests.

    from model_folders import make_model_folder, FAMILIES
    folder = make_model_folder(tmp_path, "llama3")          # weights + config.json + tokenizer
    folder = make_model_folder(tmp_path, "mistral", tokenizer=False, sliding_window=128)
    folder = make_model_folder(tmp_path, "qwen2", weights=False)     # config + tokenizer only

Each folder is what ``save_pretrained`` writes for a randomly initialised model of the family
(hidden size 64, 2 layers, GQA where the family has it) and, unless ``tokenizer=False``, a real
fast tokenizer: a byte-level BPE trained here with the ``tokenizers`` library on Python's own
help topics, wrapped as a transformers tokenizer with the family's special tokens and its
bos/eos convention, saved with ``save_pretrained``. Nothing is downloaded.

Families (the shape of the real models, in miniature):

    llama2   Llama 2: <s> prepended, </s> as eos, RoPE default
    llama3   Llama 3.1: <|begin_of_text|> prepended, <|end_of_text|> as eos, RoPE llama3
    mistral  Mistral 7B v0.3: <s> / </s>, no sliding window, rope_theta 1e6
    qwen2    Qwen2.5: no bos, <|endoftext|> as eos and pad, q/k/v biases, tied embeddings
    qwen3    Qwen3: as qwen2 plus q/k norms and a head_dim wider than hidden / heads
    gpt2     GPT-2: learned absolute positions, <|endoftext|> as bos = eos, no bos added

The weights are initialised with a large ``initializer_range`` so that logits depend strongly
on the tokens and their positions: a test comparing two computations of the loss can fail.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "qwen3", "gpt2")
"""Every family `make_model_folder` builds."""

TOKENIZER_VOCAB = 448
"""Ids of every family's tiny tokenizer (BPE merges + byte alphabet + specials)."""

_LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 512,
          "initializer_range": 0.25, "tie_word_embeddings": False}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama2": {"model_type": "llama", **_LLAMA,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "llama3": {"model_type": "llama", **_LLAMA,
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}},
    "mistral": {"model_type": "mistral", **_LLAMA, "sliding_window": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "qwen2": {"model_type": "qwen2", **_LLAMA, "tie_word_embeddings": True,
              "use_sliding_window": False, "vocab_pad": 64,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "qwen3": {"model_type": "qwen3", **_LLAMA, "head_dim": 32, "vocab_pad": 64,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512,
             "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "initializer_range": 0.25},
}
"""The tiny transformers config of each family (``vocab_pad``: spare embedding rows beyond the
tokenizer's ids, as Qwen's real checkpoints have; not a transformers key)."""

SPECIALS: dict[str, dict[str, Any]] = {
    "llama2": {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "prepend_bos": True},
    "mistral": {"bos": "<s>", "eos": "</s>", "unk": "<unk>", "prepend_bos": True},
    "llama3": {"bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "prepend_bos": True},
    "qwen2": {"eos": "<|endoftext|>", "pad": "<|endoftext|>", "prepend_bos": False},
    "qwen3": {"eos": "<|endoftext|>", "pad": "<|endoftext|>", "prepend_bos": False},
    "gpt2": {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>",
             "prepend_bos": False},
}
"""Each family's special tokens and whether its tokenizer prepends bos to every text."""


def make_model_folder(root: str | Path, family: str, *, tokenizer: bool = True,
                      weights: bool = True, seed: int = 0, name: str | None = None,
                      **config: Any) -> Path:
    """Save a tiny random model of ``family`` (and its tokenizer) to ``root/name``.

    Args:
        root: parent folder.
        family: one of `FAMILIES`.
        tokenizer: also save the family's tokenizer.
        weights: save the weights (False: config.json only, for tests that never load them).
        seed: seed of the random weights.
        name: folder name (default: the family).
        **config: transformers config fields to change (``sliding_window=128``, ...).

    Returns:
        The model folder.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(root) / (name or family)
    fields = {**CONFIGS[family], **config}
    model_type, pad = fields.pop("model_type"), fields.pop("vocab_pad", 0)
    fields.setdefault("vocab_size", TOKENIZER_VOCAB + pad)
    hf_config = AutoConfig.for_model(model_type, **_token_ids(family), **fields)
    if weights:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(hf_config).save_pretrained(folder)
    else:
        hf_config.save_pretrained(folder)
    if tokenizer:
        build_tokenizer(family).save_pretrained(folder)
    return folder


def build_tokenizer(family: str) -> Any:
    """The family's tiny fast tokenizer (a transformers tokenizer, trained here, offline)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = SPECIALS[family]
    named = {f"{k}_token": v for k, v in spec.items() if k in ("bos", "eos", "unk", "pad")}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained(family)), **named)


def special_tokens(family: str) -> list[str]:
    """The family's special tokens, each once, in id order (ids 0, 1, ...)."""
    spec = SPECIALS[family]
    return list(dict.fromkeys(spec[k] for k in ("bos", "eos", "unk", "pad") if k in spec))


def _token_ids(family: str) -> dict[str, int]:
    ids = {tok: i for i, tok in enumerate(special_tokens(family))}
    spec = SPECIALS[family]
    return {f"{k}_token_id": ids[spec[k]] for k in ("bos", "eos", "pad") if k in spec}


@functools.cache
def _trained(family: str) -> str:
    """The family's BPE tokenizer as JSON (trained once per process: about 0.1 s)."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = special_tokens(family)
    tok = Tokenizer(models.BPE(unk_token=SPECIALS[family].get("unk")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:40]], trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB, tok.get_vocab_size()
    if SPECIALS[family]["prepend_bos"]:
        bos = SPECIALS[family]["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str()
