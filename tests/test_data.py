"""Packing loses and duplicates nothing; labels, positions, padding and batches are exact."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from lctrain.config import BYTE_TOKENIZER_VOCAB, load_recipe
from lctrain.data import (
    IGNORE,
    ByteTokenizer,
    builtin_documents,
    iter_batches,
    load_tokenizer,
    pack,
    prepare_data,
    shard_batch,
)
from lctrain.data.packing import BALANCE_STEPS, epoch_order
from lctrain.errors import DataError, UserError

PAD = 999


def _corpus(seq_len: int) -> list[list[int]]:
    """Documents of awkward lengths: tiny, exactly a row, longer than two rows, ..."""
    rng = np.random.default_rng(0)
    lengths = [1, 2, seq_len, seq_len - 1, 2 * seq_len + 3, 5, seq_len + 1, 3, 7 * seq_len // 3]
    lengths += list(rng.integers(1, 2 * seq_len, size=20))
    return [list(rng.integers(0, 500, size=int(n))) for n in lengths]


def _packed(docs, seq_len, document_mask):
    ds = pack(docs, seq_len=seq_len, document_mask=document_mask, pad_id=PAD)
    rows = [ds[r] for r in range(len(ds))]
    return {name: [row[name].tolist() for row in rows] for name in rows[0]}


@pytest.mark.parametrize("document_mask", [True, False])
@pytest.mark.parametrize("seq_len", [16, 37])
def test_packing_keeps_every_token_once_with_exact_labels_and_positions(seq_len, document_mask):
    docs = _corpus(seq_len)
    stream = [t for doc in docs for t in doc]
    doc_of = [i for i, doc in enumerate(docs) for _ in doc]
    starts = np.cumsum([0] + [len(d) for d in docs])
    rows = _packed(docs, seq_len, document_mask)
    n_rows = len(rows["input_ids"])
    assert n_rows == -(-len(stream) // seq_len)
    flat = [t for row in rows["input_ids"] for t in row]
    n_pad = n_rows * seq_len - len(stream)
    assert flat[:len(stream)] == stream and flat[len(stream):] == [PAD] * n_pad
    for r in range(n_rows):
        ids, labels, pos, lens = (rows[k][r] for k in ("input_ids", "labels", "position_ids", "doc_lens"))
        assert len(ids) == len(labels) == len(pos) == seq_len and sum(lens) == seq_len
        for i in range(seq_len):
            g = r * seq_len + i
            if g >= len(stream):  # padding: no label, its own segment
                assert labels[i] == IGNORE
                continue
            if document_mask:
                same_doc = g + 1 < len(stream) and doc_of[g + 1] == doc_of[g]
                assert labels[i] == (stream[g + 1] if same_doc else IGNORE)
                assert pos[i] == g - max(starts[doc_of[g]], r * seq_len)
            else:
                assert labels[i] == (ids[i + 1] if i + 1 < seq_len and g + 1 < len(stream) else IGNORE)
                assert pos[i] == i
        if document_mask:
            edges = np.cumsum([0, *lens])
            real_edges = [e for e in edges if r * seq_len + e <= len(stream)]
            expected = sorted({0, min(seq_len, len(stream) - r * seq_len)} |
                              {int(s - r * seq_len) for s in starts if r * seq_len < s < (r + 1) * seq_len})
            assert real_edges == expected and list(edges)[-1] == seq_len
        else:
            assert lens == [seq_len]


def test_no_label_is_lost_across_rows_with_document_mask():
    docs = _corpus(16)
    rows = _packed(docs, 16, True)
    n_labels = sum(l != IGNORE for row in rows["labels"] for l in row)
    assert n_labels == sum(len(d) - 1 for d in docs)


def test_zero_tokens_is_an_error():
    with pytest.raises(DataError, match="no token"):
        pack([[], []], seq_len=8, document_mask=True, pad_id=0)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "long context — 長い文脈 ✓"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert max(ids) < tok.vocab_size == len(tok) == BYTE_TOKENIZER_VOCAB
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == f"<bos>{text}<eos>"


def test_builtin_corpus_packs_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the cache: tmp_path/lctrain/data
    cfg = load_recipe(None, seq_len=256)
    tok = load_tokenizer(cfg)
    rows = prepare_data(cfg.data, tok)
    total = sum(len(text.encode()) + 2 for text in builtin_documents())
    assert len(rows) == -(-total // 256)
    assert rows.info["built_tokens"]
    assert len(list((tmp_path / "lctrain" / "data").glob("*/rows-*.npz"))) == 1
    again = prepare_data(cfg.data, tok)
    assert not again.info["built_tokens"] and not again.info["built_rows"]
    for r in (0, len(rows) // 2, len(rows) - 1):
        assert np.array_equal(again[r]["input_ids"], rows[r]["input_ids"])
    first = tok.decode(rows[0]["input_ids"])
    assert first.startswith(builtin_documents()[0][:50])


def _cfg(source, *extra):
    return load_recipe(None, [f"data.source={source}", *extra], seq_len=64)


def _real_tokens(rows, pad_id):
    return sum(int((rows[r]["input_ids"] != pad_id).sum()) for r in range(len(rows)))


def test_files_whose_fields_differ_read_as_one_source(tmp_path):
    """A field that some files or rows lack is null there (as datasets reads them): a null text
    is an empty document, a counted skip named by its place; a JSON line without the field is
    an error naming its line; every sample keeps its file and line (blank lines counted)."""
    import random

    from lctrain.data.prepare import sample_wheres

    rng = random.Random(torch.initial_seed())
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(rng.randint(1, 9)))
             for _ in range(5)]
    first, second = tmp_path / "p1.jsonl", tmp_path / "p2.jsonl"
    first.write_text(f'{json.dumps({"text": texts[0]})}\n\n  \n{json.dumps({"text": texts[1]})}\n')
    second.write_text("".join(json.dumps(r) + "\n" for r in [
        {"text": texts[2], "meta": {"id": 3}}, {"text": None, "meta": {"id": 4}}]))
    tok = ByteTokenizer()
    rows = prepare_data(_cfg(tmp_path / "p*.jsonl").data, tok)
    assert _real_tokens(rows, tok.pad_token_id) == sum(len(t.encode()) + 2 for t in texts[:3])
    assert rows.info["skipped"] == {"empty document": [1, f"{second}:2"]}
    assert sample_wheres(rows.info["cache"], {0, 1, 2}) == {
        0: f"{first}:1", 1: f"{first}:4", 2: f"{second}:1"}
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = tmp_path / "n.parquet"
    pq.write_table(pyarrow.table({"text": [texts[3], None, texts[4]]}), str(table))
    rows = prepare_data(_cfg(table).data, tok)
    assert rows.info["skipped"] == {"empty document": [1, f"{table}: row 1"]}
    assert _real_tokens(rows, tok.pad_token_id) == sum(len(t.encode()) + 2 for t in texts[3:])
    lacking = tmp_path / "m.jsonl"
    lacking.write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n")
    with pytest.raises(DataError, match=r"m\.jsonl:2 has no 'text' field \(its fields are "
                                        r"\['body'\]\)"):
        prepare_data(_cfg(lacking).data, tok)


@pytest.mark.parametrize("order", ["null first", "null last"])
def test_a_field_only_null_in_one_file_reads_as_null_there(tmp_path, order):
    """A field that one file gives only as null and another as an object or a list is null
    in the first (datasets once failed with AttributeError on null beside an object)."""
    null = tmp_path / ("a.jsonl" if order == "null first" else "b.jsonl")
    given = tmp_path / ("b.jsonl" if order == "null first" else "a.jsonl")
    null.write_text(json.dumps({"text": "one", "meta": None, "tags": None}) + "\n")
    given.write_text(json.dumps({"text": "two", "meta": {"id": 2}, "tags": ["x"]}) + "\n")
    tok = ByteTokenizer()
    rows = prepare_data(_cfg(tmp_path / "*.jsonl").data, tok)
    texts = ["one", "two"] if order == "null first" else ["two", "one"]
    assert rows[0]["input_ids"][:10].tolist() == [t for x in texts for t in tok.encode(x)]


def test_local_jsonl_txt_and_parquet(tmp_path):
    texts = ["first document", "second one, a bit longer " * 5, "third"]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    for i, t in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(t)
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.table({"text": texts}), str(tmp_path / "a.parquet"))
    (tmp_path / "a.json").write_text(json.dumps([{"text": t} for t in texts]))
    expected = sum(len(t.encode()) + 2 for t in texts)
    tok = ByteTokenizer()
    for cfg in (_cfg(tmp_path / "a.jsonl", "data.fields.text=body"),
                _cfg(tmp_path / "doc*.txt"), _cfg(tmp_path / "a.parquet"),
                _cfg(tmp_path / "a.json"),
                _cfg(tmp_path / "a.jsonl", "data.fields.text=body", "data.max_documents=2")):
        rows = prepare_data(cfg.data, tok)
        limit = cfg.data.max_documents
        want = expected if limit is None else sum(len(t.encode()) + 2 for t in texts[:limit])
        assert _real_tokens(rows, tok.pad_token_id) == want
        assert rows.info["format"] == "text"
    with pytest.raises(DataError, match=r"a\.jsonl:1 has fields \['body'\]"):
        prepare_data(_cfg(tmp_path / "a.jsonl").data, tok)


def test_hub_dataset_offline_and_bad_tokenizer_are_user_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(UserError, match="no-such-owner/no-such-dataset"):
        prepare_data(_cfg("no-such-owner/no-such-dataset").data, tok)
    with pytest.raises(UserError, match="/no/such/tokenizer"):
        load_tokenizer(load_recipe(None, ["data.tokenizer=/no/such/tokenizer"]))


def _rows(n, seq_len=8):
    rng = np.random.default_rng(1)
    docs = [[r, *rng.integers(0, 50, size=seq_len - 1)] for r in range(n)]  # row r starts with r
    return pack(docs, seq_len=seq_len, document_mask=True, pad_id=PAD)


def _ids(batches):
    return [tuple(b.input_ids[:, 0].tolist()) for b in batches]


def test_iter_batches_is_deterministic_resumable_and_disjoint():
    ds = _rows(10)
    kw = dict(batch_size=2, dp_size=2, seed=3)
    run = _ids(itertools.islice(iter_batches(ds, dp_rank=1, start_step=0, **kw), 12))
    assert run == _ids(itertools.islice(iter_batches(ds, dp_rank=1, start_step=0, **kw), 12))
    assert run[5:] == _ids(itertools.islice(iter_batches(ds, dp_rank=1, start_step=5, **kw), 7))
    other = _ids(itertools.islice(iter_batches(ds, dp_rank=0, start_step=0, **kw), 12))
    first_token = {int(ds[r]["input_ids"][0]) for r in range(len(ds))}
    stream = [t for s in range(5) for t in other[s] + run[s]]  # 5 steps × 4 rows = 2 epochs
    assert set(stream[:10]) == set(stream[10:]) == first_token
    assert stream[:10] != stream[10:]  # each epoch reshuffled
    reseeded = _ids(itertools.islice(iter_batches(ds, dp_rank=1, start_step=0, batch_size=2,
                                                  dp_size=2, seed=4), 12))
    assert reseeded != run


@pytest.mark.parametrize("mode", ["split", "drop", "truncate_left", "truncate_right"])
def test_attention_work_is_the_sum_of_squared_document_lengths(mode):
    rng = np.random.default_rng()
    seq_len = int(rng.integers(4, 40))
    docs = [rng.integers(1, 50, int(rng.integers(1, 2 * seq_len))).tolist() for _ in range(30)]
    ds = pack(docs, seq_len=seq_len, document_mask=True, pad_id=PAD, long_samples=mode)
    want = [int((ds.row(r)["doc_lens"].astype(np.float64) ** 2).sum()) for r in range(len(ds))]
    assert ds.attention_work().tolist() == want


@pytest.mark.parametrize("rows_per_step", [2, 3, 8])
def test_epoch_order_deals_each_step_rows_of_similar_work(rows_per_step):
    """Within a window of BALANCE_STEPS steps, the steps' work ranges do not overlap (each step
    takes consecutive ranks), so a step's rows differ no more than under the plain shuffle (the
    sum of their ranges is least); every epoch still reads each row once, and without work the
    order is the plain permutation."""
    rng = np.random.default_rng()
    span = BALANCE_STEPS * rows_per_step
    n, seed = int(rng.integers(span + rows_per_step, 3 * span)), int(rng.integers(1000))
    work = rng.lognormal(10, 1.5, n).astype(np.int64)
    plain = epoch_order(n, seed, 1)
    assert epoch_order(n, seed, 1, None, rows_per_step).tolist() == plain.tolist()
    order = epoch_order(n, seed, 1, work, rows_per_step)
    assert sorted(order.tolist()) == list(range(n))
    shift = -n % rows_per_step  # epoch 1 first ends the step that epoch 0 began
    spread = {"plain": [], "dealt": []}
    for lo in range(shift, n - span + 1, span):
        for name, o in (("plain", plain), ("dealt", order)):
            steps = work[o[lo:lo + span]].reshape(BALANCE_STEPS, rows_per_step)
            spread[name] += (steps.max(1) - steps.min(1)).tolist()
        ranges = sorted((s.min(), s.max()) for s in steps)
        assert all(hi <= lo_next for (_, hi), (lo_next, _) in zip(ranges, ranges[1:]))
        assert set(order[lo:lo + span].tolist()) == set(plain[lo:lo + span].tolist())
    assert spread["dealt"] and sum(spread["dealt"]) <= sum(spread["plain"])


def test_iter_batches_tensors_and_cu_seqlens():
    ds = pack([[1, 2, 3], [4, 5, 6, 7, 8], [9] * 12], seq_len=8, document_mask=True, pad_id=PAD)
    batches = list(itertools.islice(iter_batches(ds, batch_size=1, dp_rank=0, dp_size=1, seed=0), 3))
    for b in batches:
        assert b.input_ids.shape == (1, 8) and b.input_ids.dtype == torch.int64
        assert b.cu_seqlens is None or (b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == 8)
    assert {b.cu_seqlens for b in batches} == {(0, 3, 8), (0, 4, 8), None}
    assert int(sum(b.label_tokens() for b in batches)) == 2 + 4 + 11
    with pytest.raises(DataError):
        next(iter_batches([], batch_size=1, dp_rank=0, dp_size=1, seed=0))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_batch_round_trip(layout):
    distributed = pytest.importorskip("lctrain_kernels.distributed")
    ds = pack([list(range(1, 30)), list(range(40, 60))], seq_len=48, document_mask=True, pad_id=PAD)
    (batch,) = itertools.islice(iter_batches(ds, batch_size=1, dp_rank=0, dp_size=1, seed=0), 1)
    for cp in (1, 2, 3, 4):
        whole = {n: torch.full_like(getattr(batch, n), -7) for n in ("input_ids", "labels", "position_ids")}
        for rank in range(cp):
            part = shard_batch(batch, cp_rank=rank, cp_size=cp, layout=layout)
            assert part.cu_seqlens == batch.cu_seqlens == (0, 29, 48)
            offset = 0
            for start, stop in distributed.layout_positions(48, cp, rank, layout):
                for n in whole:
                    whole[n][:, start:stop] = getattr(part, n)[:, offset:offset + stop - start]
                offset += stop - start
            assert offset == part.input_ids.shape[1] == 48 // cp
        for n in whole:
            assert torch.equal(whole[n], getattr(batch, n)), n


def test_a_missing_datasets_package_is_one_sentence(monkeypatch):
    import sys

    from lctrain.data.records import load_datasets

    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` sees uninstalled
    with pytest.raises(DataError, match=r"^reading data needs the datasets package, which "
                                        r"cannot be imported \(.*\); pip install datasets$"):
        load_datasets.__wrapped__()
