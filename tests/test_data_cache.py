"""Data preparation happens once: a later run and the other ranks reuse the cache.

The tokenizer used here is the real byte tokenizer that also records every text it is asked to
encode, so "not re-tokenized" is asserted on what really happened, not on a flag.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lctrain.config import load_recipe
from lctrain.data import ByteTokenizer, plan_steps, prepare_data, steps_summary
from lctrain.errors import DataError


class RecordingTokenizer(ByteTokenizer):
    """The byte tokenizer, keeping the texts it encoded."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.seen.append(text)
        return super().encode(text, add_special_tokens)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """The data cache of each test: $XDG_CACHE_HOME/lctrain/data (spawned ranks inherit it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def _root(tmp_path):
    return tmp_path / "xdg" / "lctrain" / "data"


def _cfg(tmp_path, source, *sets, seq_len=64):
    return load_recipe(None, [f"data.source={source}", *sets], seq_len=seq_len).data


def _rows_digest(rows):
    return [tuple(rows[r]["input_ids"].tolist()) + tuple(rows[r]["labels"].tolist())
            for r in range(len(rows))]


def test_second_run_reuses_tokens_and_rows(tmp_path):
    texts = [f"document {i}: " + "words " * (i % 13) for i in range(40)]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    first_tok = RecordingTokenizer()
    first = prepare_data(_cfg(tmp_path, src), first_tok)
    assert first.info["built_tokens"] and first.info["built_rows"]
    assert set(texts) <= set(first_tok.seen)
    again_tok = RecordingTokenizer()
    again = prepare_data(_cfg(tmp_path, src), again_tok)
    assert not again.info["built_tokens"] and not again.info["built_rows"]
    assert not set(texts) & set(again_tok.seen)  # nothing of the data was tokenized again
    assert _rows_digest(again) == _rows_digest(first)
    longer_tok = RecordingTokenizer()
    longer = prepare_data(_cfg(tmp_path, src, seq_len=128), longer_tok)  # new rows, same tokens
    assert not longer.info["built_tokens"] and longer.info["built_rows"]
    assert not set(texts) & set(longer_tok.seen)
    assert len(longer) == -(-first.info["tokens"] // 128)
    stat = src.stat()  # the file changes: prepared again, from its new content
    src.write_text("".join(json.dumps({"text": t.upper()}) + "\n" for t in texts))
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed_tok = RecordingTokenizer()
    changed = prepare_data(_cfg(tmp_path, src), changed_tok)
    assert changed.info["built_tokens"] and texts[5].upper() in changed_tok.seen
    folders = [p for p in _root(tmp_path).iterdir() if p.is_dir()]
    assert len(folders) == 2 and not list(_root(tmp_path).glob(".tmp-*"))


def test_the_tokenized_dataset_is_kept_by_its_fingerprint(tmp_path):
    """With lctrain's folder gone, the tokenized records come back from datasets' cache (the
    map's fingerprint is lctrain's cache key): nothing is tokenized again, the stream is equal."""
    import shutil

    from lctrain.bench.data import fresh_caches

    texts = [f"record {i} " * (1 + i % 9) for i in range(50)]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    with fresh_caches():
        first = prepare_data(_cfg(tmp_path, src), RecordingTokenizer())
        shutil.rmtree(first.info["cache"])
        again_tok = RecordingTokenizer()
        again = prepare_data(_cfg(tmp_path, src), again_tok)
        assert again.info["built_tokens"] and not set(texts) & set(again_tok.seen)
        assert _rows_digest(again) == _rows_digest(first)


def test_failed_preparation_leaves_no_cache(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "ok"}) + "\n" + "{broken\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2 is not valid JSON"):
        prepare_data(_cfg(tmp_path, src), ByteTokenizer())
    assert [p.name for p in _root(tmp_path).iterdir() if p.is_dir()] == []
    src.write_text(json.dumps({"text": "ok"}) + "\n")
    assert len(prepare_data(_cfg(tmp_path, src), ByteTokenizer())) == 1


def follower_and_leader(rank, world, cfg):
    """Rank 0 prepares, rank 1 waits for the cache; returns what each encoded and its rows."""
    tok = RecordingTokenizer()
    rows = prepare_data(cfg, tok, leader=rank == 0)
    return tok.seen, _rows_digest(rows), rows.info["built_tokens"]


def test_one_rank_prepares_the_others_wait(tmp_path):
    from spawn import run_on_ranks

    texts = [f"text number {i} " * 5 for i in range(30)]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (seen0, rows0, built0), (seen1, rows1, built1) = run_on_ranks(
        follower_and_leader, 2, _cfg(tmp_path, src))
    assert built0 and not built1
    assert set(texts) <= set(seen0) and not set(texts) & set(seen1)
    assert rows0 == rows1


def test_steps_from_epochs_and_max_steps():
    assert plan_steps(rows=10, rows_per_step=4, max_steps=None, epochs=2) == 5
    assert plan_steps(rows=10, rows_per_step=4, max_steps=3, epochs=2) == 3
    assert plan_steps(rows=10, rows_per_step=4, max_steps=30, epochs=None) == 30
    assert plan_steps(rows=10, rows_per_step=4, max_steps=None, epochs=None) == 3
    assert plan_steps(rows=30, rows_per_step=1, max_steps=None, epochs=0.1) == 3
    assert plan_steps(rows=1, rows_per_step=8, max_steps=None, epochs=1) == 1
    lines = steps_summary(rows=1, rows_per_step=8, steps=4, max_steps=4, epochs=None)
    assert lines[0].startswith("steps: 4 × 8 rows = 32.00 epochs of 1 rows (train.max_steps)")
    assert lines[1].startswith("warning: the data makes 1 packed row but one step takes 8")
    assert len(steps_summary(rows=16, rows_per_step=8, steps=4, max_steps=None, epochs=2)) == 1
    assert "reached before train.epochs 3" in steps_summary(
        rows=16, rows_per_step=8, steps=2, max_steps=2, epochs=3)[0]
    assert np.isclose(plan_steps(rows=7, rows_per_step=2, max_steps=None, epochs=1) * 2 / 7, 8 / 7)


def test_preparation_says_how_far_it_has_got(tmp_path, monkeypatch, capsys):
    """Into a pipe (not a terminal): the source, datasets' progress of tokenizing (stderr), then
    the totals; two processes tokenize the stream one process would; the progress line shows
    the epoch."""
    import lctrain.data.prepare as prepare
    from lctrain.train.metrics import Progress

    count = 1200  # three batches of records
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * (1 + i % 7)}) + "\n"
                            for i in range(count)))
    monkeypatch.setattr(prepare, "RECORDS_PER_PROCESS", 500)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # two cores, as CI has
    cfg = load_recipe(None, [f"data.source={path}", "data.seq_len=256"])
    rows = prepare_data(cfg.data, ByteTokenizer(), show_progress=True)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith(f"preparing data from {path} ")
    assert "tokenizing (num_proc=2)" in err and f"{count}/{count}" in err
    tokens = rows.info["tokens"]
    assert lines[1].startswith(f"prepared 1,200 records into {tokens:,} tokens in ")
    monkeypatch.setattr(prepare, "RECORDS_PER_PROCESS", 10**6)
    alone = tmp_path / "alone.jsonl"  # the same records, tokenized by this process alone
    alone.write_bytes(path.read_bytes())
    one = prepare_data(load_recipe(None, [f"data.source={alone}", "data.seq_len=256"]).data,
                       ByteTokenizer())
    assert "tokenizing" not in capsys.readouterr().err
    assert prepare.sample_wheres(rows.info["cache"], {0, 700, count - 1}) == {
        0: f"{path}:1", 700: f"{path}:701", count - 1: f"{path}:{count}"}  # from either process
    assert np.array_equal(one.stream.ids, rows.stream.ids)
    assert np.array_equal(one.stream.bounds, rows.stream.bounds) and _rows_digest(one) == _rows_digest(rows)
    progress = Progress(10, 0, enabled=True, steps_per_epoch=4)
    progress.update(2, {"loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 1.0, "lr": 1e-3,
                        "mfu": None})
    assert capsys.readouterr().out.startswith("step 2/10  epoch 0.50  loss 1.0000")
