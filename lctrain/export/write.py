"""What an export writes: the weights (full, merged, or a LoRA adapter with a random init's base
in ``base/``) and the run's tokenizer with its chat template; lctrain's byte tokenizer as an
equivalent ``PreTrainedTokenizerFast``. `staged_folder` makes the output appear whole or not at all."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from lctrain.config import RecipeConfig
from lctrain.data import BytePairTokenizer, ByteTokenizer
from lctrain.errors import unwritable
from lctrain.model import load_tokenizer
from lctrain.model.lora import ADAPTER_NAME

BYTE_SPECIALS = {"<bos>": 256, "<eos>": 257, "<pad>": 258}


def write_full(model: nn.Module, folder: Path, dtype: torch.dtype,
               max_shard_size: str = "5GB") -> None:
    """``save_pretrained`` of a plain transformers model in ``dtype``, ready for inference."""
    model.to(dtype)
    model.config.use_cache = True  # training switched the KV cache off; generation wants it
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)


def write_adapter(peft_model: nn.Module, folder: Path, dtype: torch.dtype, base_name: str) -> None:
    """peft's adapter files, naming ``base_name`` as the model to load the adapter onto."""
    peft_model.to(dtype)
    peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = base_name
    # lctrain never resizes the vocabulary (embeddings trained in full travel as
    # modules_to_save); "auto" would look the base model up, on the hub if it is not local
    peft_model.save_pretrained(str(folder), save_embedding_layers=False)


@contextlib.contextmanager
def staged_folder(output: Path, *, replace: bool) -> Iterator[Path]:
    """Yield a fresh folder beside ``output``; move it to ``output`` at the end. On an error
    the staged folder and the parents made for it are deleted, ``output`` left as it was."""
    made = [folder for folder in (output.parent, *output.parent.parents) if not folder.exists()]
    staging = output.parent / f".{output.name}.export-tmp"
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    except OSError as error:
        remove_empty(made)
        raise unwritable(f"the output {output}", error) from None
    try:
        yield staging
        try:
            if output.exists() and replace:
                shutil.rmtree(output)
            elif output.exists():
                output.rmdir()  # empty, as checked
            os.replace(staging, output)
        except OSError as error:
            raise unwritable(f"the output {output}", error) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty(made)
        raise


def remove_empty(folders: list[Path]) -> None:
    """Remove those of ``folders`` (made for an output, deepest first) that are still empty."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def byte_tokenizer_fast():
    """A transformers ``PreTrainedTokenizerFast`` equivalent to ``ByteTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # GPT-2's reversible map of the 256 byte values to printable characters
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    vocab = {chr(b) if b in printable else chr(next(extra)): b for b in range(256)}
    vocab.update(BYTE_SPECIALS)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B",
        special_tokens=[("<bos>", BYTE_SPECIALS["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        split_special_tokens=True, clean_up_tokenization_spaces=False, model_max_length=int(1e30))


def run_tokenizer(cfg: RecipeConfig) -> Any:
    """The run's tokenizer as a transformers one; None for ``byte-pairs``, which none
    reproduces."""
    tokenizer = load_tokenizer(cfg)
    if isinstance(tokenizer, BytePairTokenizer):
        return None
    if isinstance(tokenizer, ByteTokenizer):  # with data.chat_template, which renders to bytes
        fast = byte_tokenizer_fast()
        fast.chat_template = tokenizer.chat_template
        return fast
    return tokenizer


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Write ``tokenizer``'s files into ``folder`` (nothing for None)."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


def builtin_special_ids(cfg: RecipeConfig) -> dict[str, int] | None:
    """{"bos"/"eos"/"pad": id} of the run's tokenizer where it is one of lctrain's own (bytes,
    byte-pairs), whose specials a random init's config does not know; None for any other."""
    tokenizer = load_tokenizer(cfg)
    if not isinstance(tokenizer, ByteTokenizer):  # BytePairTokenizer is one too
        return None
    return {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad")}


def align_special_ids(model: nn.Module, ids: dict[str, int] | None) -> None:
    """Point the model config's bos/eos/pad ids at ``ids``, the built-in tokenizer's specials
    (a random init keeps its family's, which are bytes here), and the generation config's if
    derived from it; nothing for None."""
    if ids is None:
        return
    configs = [model.config]
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(generation, "_from_model_config", False):
        configs.append(generation)
    for config in configs:
        for name in ("bos", "eos", "pad"):
            setattr(config, f"{name}_token_id", ids[name])
