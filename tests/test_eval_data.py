"""Validation data: documents held out before packing, validation settings, evaluation batches.

- ``data.eval_source`` as a share holds out round(f × n) whole documents chosen by ``train.seed``:
  the validation rows hold exactly their tokens, the training rows exactly the others' (both
  packing families), the choice is stable across runs and lengths and moves with the seed;
- ``data.eval_source`` naming a file is prepared as its own source with the training's settings;
- `eval_batches` gives every row exactly once over the dp ranks, the same number of batches
  to each, fillers with every label masked;
- the settings refuse what cannot work, in one sentence.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from lctrain.config import load_recipe
from lctrain.data import ByteTokenizer, eval_batches, held_out, pack, prepare_data, rows_summary
from lctrain.errors import ConfigError, DataError


def _docs(path, n, rng):
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 90))) + f"#{i}"
             for i in range(n)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def _data(tmp_path, source, *sets, seq_len=32):
    return load_recipe(None, [f"data.source={source}", *sets], seq_len=seq_len).data


@pytest.mark.parametrize("mode", ["split", "drop"])
def test_held_out_documents_are_never_trained_on(tmp_path, mode):
    rng = random.Random(random.randrange(2**31))
    texts = _docs(tmp_path / "d.jsonl", 40, rng)
    seed = rng.randrange(100)  # train.seed chooses the held-out documents
    data = _data(tmp_path, tmp_path / "d.jsonl", "data.eval_source=0.25",
                 f"data.long_samples={mode}", "data.document_mask=true", seq_len=128)
    tok = ByteTokenizer()
    train, valid = prepare_data(data, tok, seed=seed), prepare_data(data, tok, part="eval",
                                                                    seed=seed)
    chosen = held_out(40, 0.25, seed)
    assert len(chosen) == 10 and len(set(chosen.tolist())) == 10
    docs = [tok.encode(t) for t in texts]
    want_eval = sorted(tuple(docs[i]) for i in chosen)
    want_train = sorted(tuple(d) for i, d in enumerate(docs) if i not in set(chosen.tolist()))

    def documents(rows):  # the samples of the rows, cut at document boundaries
        found = []
        for r in range(len(rows)):
            row, start = rows[r], 0
            for n in row["doc_lens"].tolist():
                found.append(tuple(row["input_ids"][start:start + n].tolist()))
                start += n
        pad = tok.pad_token_id
        return [d for d in found if set(d) != {pad}]

    if mode == "drop":  # whole samples: the rows hold exactly the part's documents
        assert sorted(documents(valid)) == want_eval
        assert sorted(documents(train)) == want_train
    else:  # split: the part's documents end to end, in order
        flat_eval = [t for i in chosen for t in docs[i]]
        flat_train = [t for i, d in enumerate(docs) if i not in set(chosen.tolist()) for t in d]
        joined = lambda rows: np.concatenate([rows[r]["input_ids"] for r in range(len(rows))])
        assert joined(valid)[:len(flat_eval)].tolist() == flat_eval
        assert joined(train)[:len(flat_train)].tolist() == flat_train
    assert "held out for validation: 10 of 40 documents" in "\n".join(rows_summary(train))
    assert rows_summary(valid)[0].startswith("validation data:")
    # the same documents at another length, and with another seed others
    longer = prepare_data(_data(tmp_path, tmp_path / "d.jsonl", "data.eval_source=0.25",
                                f"data.long_samples={mode}", seq_len=256), tok, part="eval",
                          seed=seed)
    if mode == "drop":
        assert sorted(documents(longer)) == want_eval
    other = held_out(40, 0.25, seed + 1)
    assert other.tolist() != chosen.tolist()


def test_eval_source_and_bad_settings(tmp_path):
    rng = random.Random(random.randrange(2**31))
    _docs(tmp_path / "train.jsonl", 12, rng)
    _docs(tmp_path / "valid.jsonl", 5, rng)
    data = _data(tmp_path, tmp_path / "train.jsonl", f"data.eval_source={tmp_path / 'valid.jsonl'}")
    valid = prepare_data(data, ByteTokenizer(), part="eval")
    alone = prepare_data(_data(tmp_path, tmp_path / "valid.jsonl"), ByteTokenizer())
    assert len(valid) == len(alone)
    for r in range(len(valid)):
        for key in ("input_ids", "labels", "position_ids", "doc_lens"):
            assert valid[r][key].tolist() == alone[r][key].tolist()
    with pytest.raises(DataError, match="no validation data"):
        prepare_data(_data(tmp_path, tmp_path / "train.jsonl"), ByteTokenizer(), part="eval")
    with pytest.raises(DataError, match="holds out none"):
        prepare_data(_data(tmp_path, tmp_path / "train.jsonl", "data.eval_source=0.01"),
                     ByteTokenizer())
    bad = {"data.eval_source=1.5": r"data.eval_source is 1.5 but a share .* must be in \(0, 1\)",
           "data.eval_source=0": r"data.eval_source is 0.0 but a share",
           "train.eval_every=5": "there is no validation data",
           "train.report_to=[jsonl,wandbb]": "report_to\\[1\\] is 'wandbb' .*did you mean 'wandb'",
           "train.report_to=[]": "train.report_to is empty",
           f"data.eval_source={tmp_path / 'missing.jsonl'}": "data.eval_source .* matches no file"}
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_recipe(None, [override])


def test_eval_batches_cover_every_row_once():
    rng = np.random.default_rng(random.randrange(2**31))
    samples = [rng.integers(0, 200, size=int(rng.integers(3, 30))).tolist() for _ in range(23)]
    rows = pack(samples, seq_len=16, document_mask=False, pad_id=258)
    n = len(rows)
    for dp, batch in ((1, 1), (2, 1), (3, 2)):
        per_rank = [list(eval_batches(rows, batch_size=batch, dp_rank=rank, dp_size=dp))
                    for rank in range(dp)]
        assert {len(b) for b in per_rank} == {-(-n // (dp * batch))}  # all ranks in step
        for rank, batches in enumerate(per_rank):
            for step, b in enumerate(batches):
                for i in range(batch):
                    r = (step * dp + rank) * batch + i  # each row once, in order
                    want = rows[r] if r < n else rows[0]
                    assert b.input_ids[i].tolist() == want["input_ids"].tolist()
                    labels = want["labels"].tolist() if r < n else [-100] * rows.seq_len
                    assert b.labels[i].tolist() == labels
    limited = list(eval_batches(rows, batch_size=1, dp_rank=0, dp_size=1, limit=3))
    assert len(limited) == 3
