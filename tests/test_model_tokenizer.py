"""The tokenizer a recipe trains with: the model folder's own by default, per-family bos/eos,
the built-in ones only for random inits, and vocabularies that must fit the model."""
from __future__ import annotations

import pytest
import torch

from lctrain.config import BYTE_PAIR_TOKENIZER_VOCAB, load_recipe
from lctrain.data import BytePairTokenizer, encode_documents, prepare_data
from lctrain.model import load_tokenizer
from lctrain.errors import ConfigError
from model_folders import FAMILIES, SPECIALS, make_model_folder

TEXTS = ["The quick brown fox.", "Long contexts need exact attention — über alles ✓", "x"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok-models")
    return {f: make_model_folder(root, f, weights=False) for f in FAMILIES}


def _cfg(folder, *sets, seq_len=64):
    return load_recipe(None, [f"model.path={folder}", "model.config=null", "data.tokenizer=null",
                              *sets], seq_len=seq_len)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_path_brings_its_tokenizer_and_its_document_convention(folders, family):
    tok = load_tokenizer(_cfg(folders[family]))
    assert type(tok).__name__ != "ByteTokenizer" and len(tok) == 448
    spec = SPECIALS[family]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert eos == tok.convert_tokens_to_ids(spec["eos"])
    assert bos == (tok.convert_tokens_to_ids(spec["bos"]) if "bos" in spec else None)
    for text, ids in zip(TEXTS, encode_documents(tok, TEXTS)):
        assert ids[-1] == eos and ids[-2] != eos  # every document ends in exactly one eos
        body = ids[1:-1] if spec["prepend_bos"] else ids[:-1]
        if spec["prepend_bos"]:
            assert ids[0] == bos  # Llama 2/3 and Mistral start every document with their bos
        else:
            assert ids[0] not in (bos, eos)  # Qwen and GPT-2 add nothing in front
        assert tok.decode(body) == text


def test_packed_rows_keep_the_family_markers(folders):
    cfg = _cfg(folders["llama3"], seq_len=32)
    tok = load_tokenizer(cfg)
    rows = prepare_data(cfg.data, tok)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    stream = [int(t) for r in range(len(rows)) for t in rows[r]["input_ids"]]
    assert stream[0] == bos
    starts = [i + 1 for i, t in enumerate(stream[:-1]) if t == eos]
    assert starts and all(stream[i] in (bos, tok.pad_token_id or eos) for i in starts)


def test_byte_tokenizers_are_refused_with_a_model_path(folders):
    for name in ("bytes", "byte-pairs"):
        with pytest.raises(ConfigError, match=rf"data.tokenizer is {name} but model.path is set.*"
                                              r"data.tokenizer=null"):
            load_recipe(None, [f"model.path={folders['qwen2']}", f"data.tokenizer={name}"])


def test_a_tokenizer_larger_than_the_model_is_refused(folders, tmp_path):
    small = make_model_folder(tmp_path, "llama3", tokenizer=False, weights=False, vocab_size=300)
    cfg = load_recipe(None, [f"model.path={small}", "model.config=null",
                             f"data.tokenizer={folders['llama3']}"])
    with pytest.raises(ConfigError, match="has 448 tokens but the model's vocab_size is 300"):
        load_tokenizer(cfg)
    random_init = load_recipe(None, [f"data.tokenizer={folders['gpt2']}"])  # vocab_size 260
    with pytest.raises(ConfigError, match="vocab_size is 260"):
        load_tokenizer(random_init)
    fits = load_recipe(None, [f"data.tokenizer={folders['gpt2']}", "model.config.vocab_size=448"])
    assert len(load_tokenizer(fits)) == 448


def test_placeholder_model_path_is_refused_where_its_tokenizer_is_needed():
    cfg = load_recipe(None, ["model.path=<folder of Qwen2.5-7B>", "model.config=null",
                             "data.tokenizer=null"])
    with pytest.raises(ConfigError, match="placeholder '<folder of Qwen2.5-7B>'.*--set model"):
        load_tokenizer(cfg)


def test_byte_pairs_round_trip_and_fill_a_large_vocabulary():
    tok = BytePairTokenizer()
    assert len(tok) == BYTE_PAIR_TOKENIZER_VOCAB == 65795
    for text in [*TEXTS, "", "ab", "abc"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        data = text.encode()
        assert len(ids) == 2 + (len(data) + 1) // 2  # two bytes a token, a lone last one
        assert max(ids) < len(tok) and tok.decode(ids) == text
    random_bytes = bytes(torch.randint(0, 256, (4001,), dtype=torch.uint8).tolist())
    ids = tok._encode_bytes(random_bytes)
    assert len(set(ids)) > 1000 and max(ids) >= 1 << 15  # spread over the vocabulary
    assert b"".join(tok._token_bytes(i) for i in ids) == random_bytes
    with pytest.raises(ConfigError, match="vocab_size is 260 but the byte-pairs tokenizer "
                                          "needs at least 65795"):
        load_recipe(None, ["data.tokenizer=byte-pairs"])
