"""``lctrain data preview``: the marked text against renderings built from the records and from
the samples' ids and targets, the row figures against the packed rows training takes, --rows,
colour on a terminal and brackets in a pipe, one-sentence mistakes, and the examples of
docs/data.md's Preview section run and compared exactly."""
from __future__ import annotations

import json
import os
import pty
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.config import load_recipe
from lctrain.data import IGNORE, ByteTokenizer, prepare_data
from lctrain.data.preview import bracketed, marked_runs, preview_rows

REPO = Path(__file__).resolve().parents[1]
ALPHABET = "abcdefghij klmnop?!.,\n\té€日本🙂"


def _words(rng: random.Random, low: int = 1, high: int = 30) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(low, high)))


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _rows(source: str, *sets: str):
    cfg = load_recipe(None, [f"data.source={source}", "data.tokenizer=bytes", *sets])
    return cfg, prepare_data(cfg.data, ByteTokenizer(), seed=cfg.train.seed)


def _invoke(*args: str):
    return CliRunner().invoke(app, ["data", "preview", *args])


# -- the marked text --------------------------------------------------------------------------

def _expected(record: dict) -> str:
    """The record as the byte tokenizer's formats make it, trained text in [[...]], by hand."""
    if "text" in record:
        return f"[[<bos>{record['text']}<eos>]]"
    if "prompt" in record:
        return f"<bos>{record['prompt']}[[{record['completion']}<eos>]]"
    return "<bos>" + "".join(f"<|{m['role']}|>\n[[{m['content']}<eos>]]" if m["role"] == "assistant"
                             else f"<|{m['role']}|>\n{m['content']}\n" for m in record["messages"])


@pytest.mark.parametrize("kind", ["text", "prompt_completion", "chat"])
def test_the_marked_text_is_each_record_with_its_trained_part_in_brackets(kind, tmp_path):
    rng = random.Random(torch.initial_seed())
    records = []
    for _ in range(rng.randint(2, 6)):
        if kind == "text":
            records.append({"text": _words(rng)})
        elif kind == "prompt_completion":
            records.append({"prompt": _words(rng, 0), "completion": _words(rng)})
        else:
            turns = [{"role": rng.choice(["system", "user"]), "content": _words(rng, 0)}]
            for _ in range(rng.randint(1, 3)):
                turns += [{"role": "assistant", "content": _words(rng)},
                          {"role": "user", "content": _words(rng, 0)}]
            records.append({"messages": turns[:rng.choice([-1, len(turns)])]})
    source = _write(tmp_path / "data.jsonl", records)
    _, rows = _rows(source, "data.seq_len=4096", "data.long_samples=drop")  # each sample whole
    shown = preview_rows(rows, ByteTokenizer(), len(rows))
    pieces = sorted((p for row in shown for p in row.pieces), key=lambda p: p.sample)
    assert [p.where for p in pieces] == [f"{source}:{i + 1}" for i in range(len(records))]
    assert [(p.start, p.stop) for p in pieces] == [(0, p.length) for p in pieces]
    assert [bracketed(p.runs) for p in pieces] == [_expected(r) for r in records]


def test_a_real_tokenizers_runs_are_its_decoded_ids_split_by_the_targets():
    """A byte-level BPE over a whole text (merges across the cuts), cut into trained and
    untrained runs at random character boundaries: the runs join to the decoded text, and each
    is the decoding of its own tokens, trained or not as the mask says."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(torch.initial_seed())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_words(rng, 20, 60) for _ in range(200)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    for _ in range(20):
        ids = fast(_words(rng, 20, 80), add_special_tokens=False)["input_ids"] + [
            fast.eos_token_id]
        whole = [i for i in range(1, len(ids)) if "\ufffd" not in fast.decode(ids[:i])]
        cuts = [0, *sorted(rng.sample(whole, min(len(whole), rng.randint(0, 5)))), len(ids)]
        mask = [k % 2 == 1 for k in range(len(cuts) - 1) for _ in range(cuts[k + 1] - cuts[k])]
        runs = marked_runs(fast, np.array(ids, np.int32), np.array(mask))
        assert "".join(text for text, _ in runs) == fast.decode(ids)
        assert runs == [(fast.decode(ids[a:b]), k % 2 == 1)
                        for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]


# -- the row figures --------------------------------------------------------------------------

@pytest.mark.parametrize("mode, mask", [("split", True), ("drop", True), ("drop", False),
                                        ("truncate_left", True)])
def test_the_row_figures_are_those_of_the_packed_rows(mode, mask, tmp_path):
    rng = random.Random(torch.initial_seed())
    records = [{"prompt": _words(rng, 0, 20), "completion": _words(rng, 1, 20)}
               for _ in range(rng.randint(5, 20))]
    source = _write(tmp_path / "pairs.jsonl", records)
    cfg, rows = _rows(source, "data.seq_len=64", f"data.long_samples={mode}",
                      f"data.document_mask={str(mask).lower()}")
    shown = preview_rows(rows, ByteTokenizer(), len(rows))
    assert len(shown) == len(rows)
    sizes = [len(r["prompt"].encode()) + len(r["completion"].encode()) + 2 for r in records]
    for view in shown:
        row = rows.row(view.index)
        pad = int((row["input_ids"] == rows.pad_id).sum())  # the byte tokenizer's pad id
        assert view.tokens + view.padding == 64 and view.padding == pad
        assert view.trained == int((row["labels"] != IGNORE).sum())
        if mask:
            assert view.documents == len(row["doc_lens"]) - (view.padding > 0)
            assert row["doc_lens"].tolist()[:view.documents] == [p.stop - p.start
                                                                   for p in view.pieces]
        for piece in view.pieces:  # every piece is its sample's, cut only where the mode says
            assert piece.length == sizes[piece.sample]
            assert (piece.start, piece.stop) == (0, piece.length) or mode != "drop"
    if mode == "drop":  # whole samples: every token of those that fit; the completions trained
        kept = [i for i, n in enumerate(sizes) if n <= 64]
        assert sorted(p.sample for v in shown for p in v.pieces) == kept
        assert sum(v.tokens for v in shown) == sum(sizes[i] for i in kept)
        completions = sum(len(records[i]["completion"].encode()) + 1 for i in kept)
        assert sum(v.trained for v in shown) == completions


# -- the command ------------------------------------------------------------------------------

def _text_source(tmp_path: Path, count: int = 7) -> str:
    return _write(tmp_path / "docs.jsonl", [{"text": "word " * 9}] * count)


@pytest.mark.parametrize("asked", [1, 2, 99])
def test_rows_shows_that_many_rows_and_no_more(asked, tmp_path):
    _, rows = _rows(_text_source(tmp_path), "data.seq_len=64")
    result = _invoke("--set", f"data.source={tmp_path / 'docs.jsonl'}", "--set",
                     "data.tokenizer=bytes", "--seq-len", "64", "--rows", str(asked))
    assert result.exit_code == 0, result.output
    shown = min(asked, len(rows))
    assert re.findall(r"^row (\d+) of (\d+)$", result.stdout, re.M) == [
        (str(i + 1), str(len(rows))) for i in range(shown)]
    table = result.stdout.split("\n---")[-1].splitlines()[1:]
    assert [line.split()[0] for line in table] == [str(i + 1) for i in range(shown)]
    assert "[[" in result.stdout and "\x1b[" not in result.stdout  # a pipe: brackets


def test_a_terminal_gets_colour_not_brackets_in_seconds(tmp_path):
    source = _text_source(tmp_path)
    main, other = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "80"}
    env.pop("NO_COLOR", None)
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "lctrain", "data", "preview", "--set", f"data.source={source}",
         "--set", "data.tokenizer=bytes", "--seq-len", "64", "--rows", "1"],
        stdout=other, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)
    os.close(other)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=120) == 0
    os.close(main)
    seconds = time.perf_counter() - start
    text = b"".join(chunks).decode()
    assert "\x1b[" in text and "[[" not in text and "word word" in text, text
    assert re.search(r"\x1b\[[0-9;]*32m<bos>word", text), text  # trained: green
    assert seconds < 60, seconds


@pytest.mark.parametrize("args, start", [
    (["--set", "data.source=missing.jsonl"], "error: data.source 'missing.jsonl' matches no file"),
    (["--set", "data.no_such_key=1"], "error: "),
    (["--set", "data.seq_len"], "error: "),
    (["no-such-recipe"], "error: "),
    (["--rows", "0"], "error: invalid value for '--rows'"),
    (["--no-such-option"], "error: no such option: --no-such-option"),
])
def test_a_mistake_is_one_sentence_and_a_non_zero_exit(args, start, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _invoke(*args)
    assert result.exit_code in (1, 2) and result.stdout == "", result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(start), result.stderr
    if result.exit_code == 2:  # the command line itself: the line names the command's help
        assert lines[0].endswith("; see lctrain data preview --help"), lines[0]
    assert "Traceback" not in result.output


def test_a_bad_record_is_one_sentence_naming_its_line(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"text": "fine"}\n{"text": \n')
    result = _invoke("--set", f"data.source={source}", "--set", "data.tokenizer=bytes")
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines()[-1].startswith(f"error: {source}:2 is not valid JSON")


# -- the documented examples ------------------------------------------------------------------

def _examples() -> list:
    """(files, command, output) of each example of docs/data.md's Preview section: a ```jsonl
    block after a paragraph naming its `FILE`, then a ```console block whose first line is
    ``$ lctrain data preview ...`` and whose other lines are the output."""
    page = (REPO / "docs" / "data.md").read_text(encoding="utf-8")
    section = page.split("\n## Preview\n", 1)[1].split("\n## ", 1)[0]
    files, out, at = {}, [], 0
    for block in re.finditer(r"^```(\w+)\n(.*?)^```$", section, re.M | re.S):
        kind, body = block.groups()
        if kind == "jsonl":
            name = re.findall(r"`([^`\s]+\.jsonl)`", section[at:block.start()])[-1]
            files[name] = body
        elif kind == "console" and body.startswith("$ lctrain data preview "):
            command, _, output = body.partition("\n")
            out.append(pytest.param(dict(files), command[2:], output, id=command[2:][:90]))
            files = {}
        at = block.end()
    return out


EXAMPLES = _examples()


def test_the_preview_section_shows_each_format():
    assert len(EXAMPLES) >= 3
    shown = " ".join(p.values[2].split("\n")[0] for p in EXAMPLES)
    for fmt in ("text", "prompt_completion", "chat"):
        assert f"format {fmt} " in shown, fmt


@pytest.mark.parametrize("files, command, output", EXAMPLES)
def test_a_documented_preview_prints_what_the_page_shows(files, command, output, tmp_path,
                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    words = shlex.split(command)
    assert words[:3] == ["lctrain", "data", "preview"] and "data.tokenizer=bytes" in words
    result = CliRunner().invoke(app, words[1:])
    assert result.exit_code == 0, result.output
    assert result.stdout == output
