"""Record formats, loss masks, bad records and long samples, through the real preparation.

Every expectation is built independently from the records (bytes of the texts, by hand), never
by calling the code under test a second way.
"""
from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import torch

from lctrain.config import load_recipe
from lctrain.data import (
    IGNORE,
    ByteTokenizer,
    iter_batches,
    pack,
    prepare_data,
    rows_summary,
    shard_batch,
)
from lctrain.errors import ConfigError, DataError

TOK = ByteTokenizer()
BOS, EOS, PAD = TOK.bos_token_id, TOK.eos_token_id, TOK.pad_token_id


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _prepare(tmp_path, source, *sets, seq_len=64):
    cfg = load_recipe(None, [f"data.source={source}", *sets], seq_len=seq_len)
    return prepare_data(cfg.data, TOK)


def _stream(rows):
    """Every row's real tokens and labels, in row order (padding removed)."""
    ids, labels = [], []
    for r in range(len(rows)):
        row = rows[r]
        real = row["input_ids"] != PAD
        ids.append(row["input_ids"][real])
        labels.append(row["labels"][real])
    return ids, labels


def _text(n):
    return "".join(random.choice("abcdefghij XYZ.") for _ in range(n))


def test_prompt_completion_trains_on_the_completion_and_eos_only(tmp_path):
    pairs = [(_text(random.randint(0, 20)), _text(random.randint(1, 12))) for _ in range(30)]
    src = _write(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    rows = _prepare(tmp_path, src, "data.long_samples=drop")
    assert rows.info["format"] == "prompt_completion" and "prompt and completion" in rows.info["format_reason"]
    want_targets = sum(len(c) + 1 for _, c in pairs)  # completion bytes + eos
    ids, labels = _stream(rows)
    assert sum(int((lab != IGNORE).sum()) for lab in labels) == want_targets
    samples = {}
    for p, c in pairs:  # the label sequence of one sample: IGNORE for the prompt, then c + eos
        seq = [BOS, *p.encode(), *c.encode(), EOS]
        lab = [IGNORE] * (len(p) + 1) + [*c.encode(), EOS]
        samples.setdefault(tuple(seq), []).append(lab[1:] + [IGNORE])
    for row_ids, row_labels in zip(ids, labels):  # whole samples: split each row at bos
        starts = np.flatnonzero(row_ids == BOS).tolist() + [row_ids.size]
        for a, b in zip(starts[:-1], starts[1:]):
            key = tuple(row_ids[a:b].tolist())
            assert row_labels[a:b].tolist() in samples[key]


def test_detection_and_text_field_that_is_not_a_string(tmp_path):
    chat = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    src = _write(tmp_path / "chat.jsonl", chat * 3)
    assert _prepare(tmp_path, src).info["format"] == "chat"
    assert _prepare(tmp_path, src, "data.fields.text=messages").info["format"] == "chat"
    with pytest.raises(DataError, match=r"chat\.jsonl:1: 'messages' is a list, not a string"):
        _prepare(tmp_path, src, "data.fields.text=messages", "data.format=text")
    tok_src = _write(tmp_path / "t.jsonl", [{"input_ids": [5, 6, 7], "text": "ignored"}])
    assert _prepare(tmp_path, tok_src).info["format"] == "tokenized"
    odd = _write(tmp_path / "odd.jsonl", [{"body": "x"}])
    with pytest.raises(DataError, match=r"odd\.jsonl:1 has fields \['body'\].*data\.fields\.text"):
        _prepare(tmp_path, odd)
    null = _write(tmp_path / "null.jsonl", [{"prompt": "x", "completion": None}])
    with pytest.raises(DataError, match=r"null\.jsonl:1 has fields \['prompt'\] \(completion: null\)"):
        _prepare(tmp_path, null)
    with pytest.raises(ConfigError, match="data.format"):
        load_recipe(None, ["data.format=sharegpt"])


def test_tokenized_records_with_and_without_labels(tmp_path):
    recs = [{"input_ids": [10, 11, 12, 13], "labels": [-100, -100, 12, 13]},
            {"input_ids": [20, 21, 22]}]
    rows = _prepare(tmp_path, _write(tmp_path / "tok.jsonl", recs), seq_len=16)
    assert rows.info["has_labels"] and rows.info["long_samples"] == "drop"
    row = rows[0]  # both fit one row, in order: [10 11 12 13][20 21 22] pad...
    assert row["input_ids"][:7].tolist() == [10, 11, 12, 13, 20, 21, 22]
    assert row["labels"][:7].tolist() == [IGNORE, 12, 13, IGNORE, 21, 22, IGNORE]
    assert row["doc_lens"].tolist() == [4, 3, 9]
    bad = [({"input_ids": [1, 2], "labels": [1]}, "labels has 1 entries"),
           ({"input_ids": [1, 2], "labels": [2, -100]}, r"labels\[0\] is 2 but input_ids\[0\] is 1"),
           ({"input_ids": [1, 999]}, "input_ids holds 999, outside the tokenizer's vocabulary of 259"),
           ({"input_ids": "1 2 3"}, "input_ids must be a list of whole numbers"),
           ({"input_ids": [1.5, 2]}, "input_ids must be a list of whole numbers, but it holds 1.5"),
           ({"input_ids": [1, None]}, "input_ids must be a list of whole numbers, but it holds None")]
    for i, (record, message) in enumerate(bad):
        src = _write(tmp_path / f"bad{i}.jsonl", [{"input_ids": [3, 4]}, record])
        with pytest.raises(DataError, match=rf"bad{i}\.jsonl:2: {message}"):
            _prepare(tmp_path, src)


def test_ragged_nested_ids_are_one_sentence(tmp_path):
    """Lists of lists of different lengths (ragged) name the record, as even ones do (numpy
    once raised its own ValueError on them)."""
    for i, (record, message) in enumerate([
            ({"input_ids": [[1, 2], [3]]}, r"input_ids must be a list of whole numbers, but it "
                                           r"holds \[1, 2\]"),
            ({"input_ids": [1, 2, 3], "labels": [[1], [2, 3]]},
             r"labels must be a list of whole numbers, but it holds \[1\]")]):
        src = _write(tmp_path / f"ragged{i}.jsonl", [record])
        with pytest.raises(DataError, match=rf"^{tmp_path}/ragged{i}\.jsonl:1: {message}$"):
            _prepare(tmp_path, src)


def test_bad_lines_are_errors_with_file_and_line(tmp_path):
    good = json.dumps({"text": "fine"}) + "\n"
    cases = {"json": (good + "\n" + '{"text": "unterminated\n', r"json\.jsonl:3 is not valid JSON"),
             "array": (good + "[1, 2]\n", r"array\.jsonl:2 is a JSON list, not an object")}
    for name, (text, message) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        with pytest.raises(DataError, match=message):
            _prepare(tmp_path, path)
    raw = tmp_path / "latin.jsonl"
    raw.write_bytes(good.encode() + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl:2 is not UTF-8 text \(byte 0xe9 at column 14\)"):
        _prepare(tmp_path, raw)
    txt = tmp_path / "doc.txt"
    txt.write_bytes(b"line one\nline \xff two\n")
    with pytest.raises(DataError, match=r"doc\.txt:2 is not UTF-8 text \(byte 0xff at column 6\)"):
        _prepare(tmp_path, txt)
    pc = _write(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "only"}])
    with pytest.raises(DataError, match=r"pc\.jsonl:2 has no 'completion' field"):
        _prepare(tmp_path, pc, "data.format=prompt_completion")


def test_jsonl_files_holding_an_array_or_objects_over_several_lines(tmp_path):
    """datasets reads a .jsonl file that holds one JSON array, or objects written over several
    lines, as records: lctrain trains on them too (and names a bad one by record, not line)."""
    array = tmp_path / "array.jsonl"
    array.write_text(json.dumps([{"text": "first doc"}, {"text": "second doc"}]) + "\n")
    pretty = tmp_path / "pretty.jsonl"
    pretty.write_text("".join(json.dumps(r, indent=2) + "\n"
                              for r in ({"text": "one"}, {"text": "two"})))
    for path in (array, pretty):
        assert _prepare(tmp_path, path).info["samples"] == 2
    for i, (tail, message) in enumerate([("[1, 2]\n", "record 1 is a JSON list, not an object"),
                                         ('{\n  "text": "tw\n', ":5 is not valid JSON")]):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(json.dumps({"text": "one"}, indent=2) + "\n" + tail)
        with pytest.raises(DataError, match=rf"bad{i}\.jsonl{message}|bad{i}\.jsonl: {message}"):
            _prepare(tmp_path, bad)


def test_empty_records_are_counted_skips_named_in_the_banner(tmp_path):
    recs = [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": ""},
            {"prompt": "q", "completion": None}, {"prompt": "r", "completion": "d"}]
    rows = _prepare(tmp_path, _write(tmp_path / "pc.jsonl", recs))
    assert rows.info["samples"] == 2
    banner = "\n".join(rows_summary(rows))
    assert "2 skipped (empty completion: 2, first at" in banner and "pc.jsonl:2)" in banner
    text = _write(tmp_path / "t.jsonl", [{"text": ""}, {"text": "x"}, {"text": None}])
    banner = "\n".join(rows_summary(_prepare(tmp_path, text)))
    assert "2 skipped (empty document: 2, first at" in banner and "t.jsonl:1)" in banner
    chats = [{"messages": []}, {"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(DataError, match="yields no token to train on: 2 skipped .no assistant "
                                        r"turn: 2, first at .*c\.jsonl:1\)"):
        _prepare(tmp_path, _write(tmp_path / "c.jsonl", chats), "data.turns=all_or_skip")
    empty = _write(tmp_path / "e.jsonl", [{"text": ""}])  # the validation file is named as such
    cfg = load_recipe(None, [f"data.source={text}", f"data.eval_source={empty}"], seq_len=64)
    with pytest.raises(DataError, match=r"^data\.eval_source '.*e\.jsonl' yields no token"):
        prepare_data(cfg.data, TOK, part="eval")


def test_long_samples_rules(tmp_path):
    lengths = [3, 40, 9, 70, 12, 100, 5]
    recs = [{"prompt": "", "completion": _text(n)} for n in lengths]  # bos + n bytes + eos
    src = _write(tmp_path / "pc.jsonl", recs)
    sizes = [n + 2 for n in lengths]
    for mode in ("drop", "truncate_left", "truncate_right"):
        rows = _prepare(tmp_path, src, f"data.long_samples={mode}", seq_len=32)
        kept = [s for s in sizes if s <= 32] if mode == "drop" else [min(s, 32) for s in sizes]
        assert rows.plan.long == sum(s > 32 for s in sizes) == 3
        got = sorted(int(n) for r in range(len(rows)) for n in rows[r]["doc_lens"][
            : len(rows[r]["doc_lens"]) - (rows[r]["input_ids"][-1] == PAD)])
        assert got == sorted(kept), mode
        banner = "\n".join(rows_summary(rows))
        assert "long samples: 3 longer than 32 tokens" in banner and "pc.jsonl:2" in banner
        ids, _ = _stream(rows)
        pieces = {tuple(x.tolist()) for x in ids}
        full = [[BOS, *r["completion"].encode(), EOS] for r in recs]
        for f in full:
            if len(f) <= 32:
                assert any(_contains(p, f) for p in pieces)
            elif mode != "drop":
                part = f[-32:] if mode == "truncate_left" else f[:32]
                assert any(_contains(p, part) for p in pieces)
    split = _prepare(tmp_path, src, "data.long_samples=split", seq_len=32)
    ids, _ = _stream(split)
    assert np.concatenate(ids).tolist() == [t for r in recs for t in [BOS, *r["completion"].encode(), EOS]]


def _contains(haystack, needle):
    n = len(needle)
    return any(list(haystack[i:i + n]) == needle for i in range(len(haystack) - n + 1))


def test_truncating_away_every_target_leaves_the_sample_out():
    rows = pack([[1] * 10, [2] * 4], seq_len=6, document_mask=True, pad_id=0,
                targets=[[False] * 8 + [True] * 2, [True] * 4], long_samples="truncate_right")
    assert rows.plan.long == 1 and rows.plan.left_out == 1 and len(rows) == 1
    left = pack([[1] * 10, [2] * 4], seq_len=6, document_mask=True, pad_id=0,
                targets=[[False] * 8 + [True] * 2, [True] * 4], long_samples="truncate_left")
    assert left.plan.left_out == 0 and len(left) == 2


@pytest.mark.parametrize("document_mask", [True, False])
def test_whole_sample_packing_is_best_fit_and_loses_nothing(document_mask):
    rng = np.random.default_rng(random.randrange(2**31))
    lengths = rng.integers(1, 60, size=80)
    # sample k starts with the unique id 300 + k, so every piece is identified exactly
    docs = [[300 + k, *rng.integers(0, 200, size=int(n) - 1)] for k, n in enumerate(lengths)]
    flags = [list(rng.random(int(n)) < 0.6) for n in lengths]
    rows = pack(docs, seq_len=64, document_mask=document_mask, pad_id=255, targets=flags,
                long_samples="drop")
    assert len(rows) <= 11 / 9 * -(-int(lengths.sum()) // 64) + 1  # best-fit decreasing's bound
    seen = []
    for r in range(len(rows)):
        row = rows[r]
        ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
        n_real = sum(t != 255 for t in ids)
        assert ids[n_real:] == [255] * (64 - n_real) and labels[n_real:] == [IGNORE] * (64 - n_real)
        starts = [i for i, t in enumerate(ids) if t >= 300] + [n_real]
        assert starts[0] == 0
        want = []
        for a, b in zip(starts[:-1], starts[1:]):
            k = ids[a] - 300
            assert ids[a:b] == docs[k]
            seen.append(k)
            nxt = flags[k][1:] + ([] if document_mask or b == n_real else [flags[ids[b] - 300][0]])
            want += [ids[a + j + 1] if f else IGNORE for j, f in enumerate(nxt)]
            want += [IGNORE] * (b - a - len(nxt))
        assert labels[:n_real] == want
        if document_mask:
            assert row["doc_lens"].tolist() == [b - a for a, b in zip(starts[:-1], starts[1:])] + (
                [64 - n_real] if n_real < 64 else [])
            assert row["position_ids"][:n_real].tolist() == [
                i - a for a, b in zip(starts[:-1], starts[1:]) for i in range(a, b)]
        else:
            assert row["doc_lens"].tolist() == [64]
    assert sorted(seen) == list(range(len(docs)))



@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_masked_labels_are_the_same_at_any_cp(tmp_path, layout):
    from lctrain_kernels.distributed import layout_positions

    pairs = [{"prompt": _text(random.randint(5, 40)), "completion": _text(random.randint(1, 9))}
             for _ in range(12)]
    rows = _prepare(tmp_path, _write(tmp_path / "pc.jsonl", pairs), seq_len=96)
    batches = itertools.islice(iter_batches(rows, batch_size=1, dp_rank=0, dp_size=1, seed=0),
                               len(rows))
    for batch in batches:
        for cp in (2, 3):
            whole, count = torch.full_like(batch.labels, -7), 0
            for rank in range(cp):
                part = shard_batch(batch, cp_rank=rank, cp_size=cp, layout=layout)
                count += int(part.label_tokens())
                offset = 0
                for start, stop in layout_positions(96, cp, rank, layout):
                    whole[:, start:stop] = part.labels[:, offset:offset + stop - start]
                    offset += stop - start
            assert torch.equal(whole, batch.labels)
            assert count == int(batch.label_tokens()) > 0
