"""Passkey prompts: exact length, the needle where asked in tokens, answers read back.

Checked with lctrain's byte tokenizer and with a transformers tokenizer (the byte tokenizer's
exported twin), against the text the prompt must decode to — not against the code's own
arithmetic.
"""
from __future__ import annotations

import random

import pytest

from lctrain.data import ByteTokenizer
from lctrain.errors import UserError
from lctrain.eval.passkey import (FILLER, INTRO, NEEDLE, QUESTION, PasskeyCase, answer_text,
                                  answer_tokens, parse_answer, passkey_cases, passkey_prompt,
                                  summarize)
from lctrain.export.write import byte_tokenizer_fast


@pytest.fixture(scope="module", params=["bytes", "transformers"])
def tokenizer(request):
    return ByteTokenizer() if request.param == "bytes" else byte_tokenizer_fast()


def test_prompt_length_needle_and_question(tokenizer):
    rng = random.Random(random.randrange(2**31))
    longest_sentence = max(len(" " + s) for s in FILLER)  # bytes = tokens here
    for _ in range(6):
        length, depth = rng.randrange(400, 3000), rng.choice([0.0, 1.0, rng.random()])
        key = str(rng.randint(10000, 99999))
        p = passkey_prompt(tokenizer, length, depth, key)
        assert len(p.ids) == length
        assert p.ids[0] == 256  # bos first
        text = tokenizer.decode(p.ids, skip_special_tokens=True)
        needle = " " + NEEDLE.format(key=key)
        assert text.startswith(INTRO) and text.endswith(" " + QUESTION)
        assert text.count(key) == 2 and needle in text
        # the needle's tokens are where the prompt says, and decode to the needle
        assert tokenizer.decode(p.ids[p.needle_start:p.needle_stop]) == needle
        # it sits at a sentence boundary of the filler, at most one sentence before the asked
        # depth (in tokens of the filler)
        before = tokenizer.decode(p.ids[p.filler_start:p.needle_start])
        assert before == "" or before.endswith(".")
        asked = round(depth * p.filler_tokens)
        placed = p.needle_start - p.filler_start
        assert 0 <= asked - placed < longest_sentence
        assert p.placed_depth == pytest.approx(placed / p.filler_tokens)
    with pytest.raises(UserError, match="too short"):
        passkey_prompt(tokenizer, 100, 0.5, "12345")


def test_answers_are_parsed_and_counted(tokenizer):
    assert parse_answer(" 71432. Remember") == "71432"
    assert parse_answer(" the key is 0071 or 5") == "0071"
    assert parse_answer("no digits here") is None
    assert answer_tokens(tokenizer, "12345") == len(" 12345.") + 1
    cases = passkey_cases([512, 1024], [0.0, 1.0], 2, seed=3)
    assert cases == passkey_cases([512, 1024], [0.0, 1.0], 2, seed=3)  # every rank agrees
    assert len({c.passkey for c in cases}) > 1 and all(len(c.passkey) == 5 for c in cases)
    outcomes = [{"answer": f" {c.passkey}." if c.trial == 0 else " 1", "needle_start": 7,
                 "placed_depth": c.depth} for c in cases]
    rows = summarize(cases, outcomes)
    assert [(r["seq_len"], r["depth"]) for r in rows] == [(512, 0.0), (512, 1.0), (1024, 0.0),
                                                          (1024, 1.0)]
    assert all(r["trials"] == 2 and r["correct"] == 1 and r["accuracy"] == 0.5 for r in rows)
    one = summarize([PasskeyCase(512, 0.5, 0, "11111")],
                    [{"answer": "\x1b\x07 11111\n", "needle_start": 3, "placed_depth": 0.5}])
    assert one[0]["correct"] == 1 and "\x1b" not in one[0]["answer"]  # shown safely
    eos = tokenizer.eos_token_id  # the model's answer ends at its end-of-text token
    ids = tokenizer.encode(" 123", add_special_tokens=False)
    more = tokenizer.encode("45.", add_special_tokens=False)
    assert parse_answer(answer_text(tokenizer, ids + [eos] + more)) == "123"
    assert parse_answer(answer_text(tokenizer, ids + more)) == "12345"


def test_greedy_picks_among_the_tokenizers_ids_only():
    import torch

    from lctrain.eval.decode import pick_token

    logits = torch.randn(3, 1024)
    logits[:, 700] = 100.0  # the best id overall is one no tokenizer of 259 ids can write
    assert pick_token(logits, None).flatten().tolist() == [700] * 3
    assert pick_token(logits, None, 259).flatten().tolist() == logits[:, :259].argmax(-1).tolist()
