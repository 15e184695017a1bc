"""A bad data source fails before any rank starts, with the sentence preparing the data gives."""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time

import pytest
import torch

from lctrain.config import load_recipe
from lctrain.data import ByteTokenizer, prepare_data
from lctrain.data.check import FIRST_RECORDS, check_first_records
from lctrain.errors import DataError

GOOD = {"text": lambda rng: "".join(rng.choice("abc xyz") for _ in range(rng.randint(5, 40))),
        "prompt_completion": lambda rng: {"prompt": "q" * rng.randint(1, 9),
                                          "completion": "a" * rng.randint(1, 9)}}


def _lines(rng: random.Random, n: int) -> list[str]:
    return [json.dumps({"text": GOOD["text"](rng)}) for _ in range(n)]


def _bad_sources(rng: random.Random) -> dict[str, bytes]:
    """Sources whose fault sits in the first records (its line drawn at random)."""
    lines = _lines(rng, FIRST_RECORDS - 1)
    at = rng.randrange(len(lines) + 1)

    def with_line(bad: str) -> bytes:
        return "\n".join(lines[:at] + [bad] + lines[at:]).encode() + b"\n"

    pc = [json.dumps(GOOD["prompt_completion"](rng)) for _ in range(3)]
    return {
        "missing_field.jsonl": with_line(json.dumps({"txt": "oops"})),
        "bad_json.jsonl": with_line('{"text": "unclosed'),
        "not_object.jsonl": with_line(json.dumps(["text", "a list"])),
        "not_utf8.jsonl": with_line('{"text": "x"}')[:-1] + b"\n" + b'{"text": "\xff"}\n',
        "mistyped.jsonl": with_line(json.dumps({"text": rng.randint(0, 99)})),
        "unknown_format.jsonl": json.dumps({"body": "x"}).encode() + b"\n" + "\n".join(lines).encode(),
        "pc_missing.jsonl": "\n".join(pc + [json.dumps({"prompt": "only"})]).encode(),
        "chat_bad.jsonl": json.dumps({"messages": [{"role": "user"}]}).encode(),
        "empty.jsonl": b"\n\n",
        "all_empty.jsonl": b'{"text": ""}\n' * rng.randint(1, FIRST_RECORDS),
        "array.json": b'[{"text": "a"},\n {"text": 3}]',
    }


def _prepare_error(data) -> str:
    with pytest.raises(DataError) as caught:
        prepare_data(data, ByteTokenizer())
    return str(caught.value)


def test_the_first_records_give_the_error_the_ranks_would(tmp_path):
    rng = random.Random(torch.initial_seed())
    for name, content in _bad_sources(rng).items():
        path = tmp_path / name
        path.write_bytes(content)
        data = load_recipe(None, [f"data.source={path}"]).data
        loaded = []
        with pytest.raises(DataError) as caught:
            check_first_records(data, lambda: loaded.append(1) or ByteTokenizer())
        assert str(caught.value) == _prepare_error(data), name  # the ranks' own sentence
        assert "\n" not in str(caught.value) and len(loaded) <= 1
    # the same for data.eval_source, named as such
    good, bad = tmp_path / "good.jsonl", tmp_path / "missing_field.jsonl"
    good.write_text("\n".join(_lines(rng, 3)))
    data = load_recipe(None, [f"data.source={good}", f"data.eval_source={bad}"]).data
    with pytest.raises(DataError, match=r"missing_field.jsonl:\d+ has (no 'text' field|fields)"):
        check_first_records(data, ByteTokenizer)


def test_good_sources_pass_and_only_the_first_records_are_read(tmp_path):
    rng = random.Random(torch.initial_seed())
    path = tmp_path / "data.jsonl"
    lines = _lines(rng, FIRST_RECORDS + rng.randint(1, 5))
    lines[0] = json.dumps({"text": ""})  # skipped, as preparing skips it
    path.write_text("\n".join(lines + [json.dumps({"txt": "late"})]) + "\n")
    data = load_recipe(None, [f"data.source={path}"]).data
    check_first_records(data, ByteTokenizer)  # the late fault is the ranks' to find
    assert "has no 'text' field" in _prepare_error(data)
    calls = []
    check_first_records(load_recipe(None).data, lambda: calls.append(1))  # builtin: no tokenizer
    assert calls == []


def test_finetune_with_a_bad_record_fails_before_the_ranks_start(tmp_path):
    rng = random.Random(torch.initial_seed())
    lines = _lines(rng, rng.randint(1, FIRST_RECORDS - 1))
    line = rng.randint(2, len(lines) + 1)  # the first record says the format
    lines.insert(line - 1, json.dumps({"txt": "oops"}))
    source, out = tmp_path / "BAD.jsonl", tmp_path / "run"
    source.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lctrain", "finetune", "--set",
                           f"data.source={source}", "--output-dir", str(out), "--max-steps", "2"],
                          capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    assert done.returncode == 1, done.stderr
    expected = _prepare_error(load_recipe(None, [f"data.source={source}"]).data)
    assert f"{source}:{line} " in expected
    assert done.stderr.strip().splitlines() == [f"error: {expected}"], done.stderr
    launch = out / ".launch"
    assert sorted(p.name for p in launch.iterdir()) == ["lock"]  # no rank log, no error record
    assert not (out / "config.yaml").exists()
    assert elapsed < 30, elapsed  # the ranks' start alone takes longer on a CPU
