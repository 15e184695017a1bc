"""A tokenizer (data.tokenizer) or dataset (data.source, data.eval_source) given by hub name that
neither the hub nor its cache can give is refused at once, in one sentence naming the setting:
offline mode without a probe, an unreachable hub after one short probe (where transformers and
datasets would retry for 20 s to minutes). A cached one passes, and a cached tokenizer loads at
once. Nothing here needs the network: the hub is a closed port on this machine."""
from __future__ import annotations

import dataclasses
import glob
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lctrain.config import load_recipe
from lctrain.config.hub import check_hub_dataset
from lctrain.data import load_tokenizer, prepare_data
from lctrain.data.records import RecordReader
from lctrain.data.tokenizer import ByteTokenizer
from lctrain.errors import ConfigError, UserError
from model_folders import TOKENIZER_VOCAB, make_model_folder
from test_hub_cache import CLOSED, hub_cache_copy, unreachable_env

TOKENIZER = "someone/tiny-tokenizer"
DATASET = "someone/docs"


@pytest.fixture
def unreachable(monkeypatch):
    """Offline mode off, the hub a closed local port."""
    for flag in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", CLOSED)


def _refusal(call) -> str:
    """The message of the ConfigError ``call`` raises, which must come within 2 s."""
    start = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        call()
    assert time.monotonic() - start < 2
    message = str(raised.value)
    assert "\n" not in message and ". " not in message, message
    return message


def test_an_uncached_hub_tokenizer_is_refused_at_once(empty_cache, monkeypatch):
    cfg = load_recipe(None, [f"data.tokenizer={TOKENIZER}"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _refusal(lambda: load_tokenizer(cfg)) == (
        f"could not read the tokenizer '{TOKENIZER}' (data.tokenizer): it is a hub name, but "
        f"HF_HUB_OFFLINE is set (offline mode) and the local hub cache ({empty_cache}) does not "
        "hold it; download it while online, unset HF_HUB_OFFLINE, or point data.tokenizer at a "
        "local tokenizer folder")


def test_an_uncached_hub_tokenizer_with_the_hub_out_of_reach_is_refused_at_once(
        empty_cache, unreachable):
    cfg = load_recipe(None, [f"data.tokenizer={TOKENIZER}"])
    assert _refusal(lambda: load_tokenizer(cfg)) == (
        f"could not read the tokenizer '{TOKENIZER}' (data.tokenizer): it is a hub name, but the "
        f"hub {CLOSED} cannot be reached from this machine and the local hub cache "
        f"({empty_cache}) does not hold it; point data.tokenizer at a local tokenizer folder, or "
        "run where the hub can be reached")


_LOAD_TOKENIZER = """
import json, sys, time
from lctrain.config import load_recipe
from lctrain.data import load_tokenizer

start = time.monotonic()
tokenizer = load_tokenizer(load_recipe(None, [f"data.tokenizer={sys.argv[1]}",
                                            "model.config.vocab_size=512"]))
print(json.dumps({"seconds": time.monotonic() - start, "tokens": len(tokenizer)}))
"""


def test_a_cached_hub_tokenizer_loads_at_once_with_the_hub_out_of_reach(tmp_path):
    folder = make_model_folder(tmp_path, "qwen2", weights=False, name="source")
    hub_cache_copy(folder, tmp_path / "hf", TOKENIZER)
    done = subprocess.run([sys.executable, "-c", _LOAD_TOKENIZER, TOKENIZER],
                          env=unreachable_env(tmp_path / "hf"), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == TOKENIZER_VOCAB and "Retrying" not in done.stderr, done.stderr
    assert result["seconds"] < 5, result  # one refused probe, not transformers' retries


@pytest.mark.parametrize("key", ["data.source", "data.eval_source"])
def test_an_uncached_hub_dataset_is_refused_at_once(tmp_path, monkeypatch, key):
    """Offline mode (as the test session runs) and the datasets cache empty."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _datasets_cache(monkeypatch, tmp_path)
    cfg = load_recipe(None, [f"{key}={DATASET}"])
    part = "eval" if key == "data.eval_source" else "train"
    assert _refusal(lambda: prepare_data(cfg.data, ByteTokenizer(), part=part)) == (
        f"could not read the hub dataset '{DATASET}' ({key}): it is a hub name, but "
        f"HF_DATASETS_OFFLINE is set (offline mode) and the datasets cache ({tmp_path}) does not "
        f"hold it; download it while online, unset HF_DATASETS_OFFLINE, or point {key} at local "
        f".jsonl/.parquet/.txt files or use {key}=builtin")


def _datasets_cache(monkeypatch, folder) -> None:
    """``folder`` as the datasets cache (HF_DATASETS_CACHE, as datasets reads it)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)


def test_an_uncached_hub_dataset_with_the_hub_out_of_reach_is_refused_at_once(
        tmp_path, unreachable, monkeypatch):
    _datasets_cache(monkeypatch, tmp_path)
    cfg = load_recipe(None, [f"data.source={DATASET}"])
    assert _refusal(lambda: prepare_data(cfg.data, ByteTokenizer())) == (
        f"could not read the hub dataset '{DATASET}' (data.source): it is a hub name, but the hub "
        f"{CLOSED} cannot be reached from this machine and the datasets cache ({tmp_path}) does "
        "not hold it; point data.source at local .jsonl/.parquet/.txt files or use "
        "data.source=builtin, or run where the hub can be reached")


def _cached_dataset(cache, texts, valid=("a validation document",)):
    """Leave in ``cache`` what ``load_dataset(DATASET)`` keeps of a download: the prepared Arrow
    copy (splits train and validation) in someone___docs/default/0.0.0/<hash>/ (made here from
    local JSON lines)."""
    import datasets

    files, build = {}, cache.with_name(cache.name + "-build")
    for split, docs in (("train", texts), ("validation", valid)):
        files[split] = str(build.with_name(f"{cache.name}-{split}.jsonl"))
        Path(files[split]).write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    datasets.load_dataset("json", data_files=files, cache_dir=str(build))
    built, = glob.glob(str(build / "json" / "*" / "0.0.0" / "*[0-9a-f]"))
    target = cache / "someone___docs" / "default" / "0.0.0" / "0123abcd"
    shutil.copytree(built, target)
    for split in files:
        (target / f"json-{split}.arrow").rename(target / f"docs-{split}.arrow")


def test_a_cached_hub_dataset_passes(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    texts = ["the first document", "the second one"]
    _cached_dataset(cache, texts)
    _datasets_cache(monkeypatch, cache)
    cfg = load_recipe(None, [f"data.source={DATASET}", "data.seq_len=64"])
    rows = prepare_data(cfg.data, ByteTokenizer())  # offline mode: datasets reads its cache
    assert rows.info["samples"] == len(texts)
    assert rows.info["tokens"] == sum(len(t.encode()) + 2 for t in texts)
    valid = ["held apart", "for validation only", "a third"]  # data.source=org/name[split]
    _cached_dataset(tmp_path / "cache2", texts, valid)
    _datasets_cache(monkeypatch, tmp_path / "cache2")
    split = load_recipe(None, [f"data.source={DATASET}[validation]", "data.seq_len=64"]).data
    read = list(RecordReader(split))
    assert [r.fields["text"] for r in read] == valid and read[1].where == f"{DATASET}[validation] row 1"
    rows = prepare_data(split, ByteTokenizer())
    assert rows.info["samples"] == len(valid) and rows.info["cache"] != str(cache)
    assert rows.info["tokens"] == sum(len(t.encode()) + 2 for t in valid)
    with pytest.raises(UserError, match=r"split 'test'"):
        prepare_data(dataclasses.replace(split, source=f"{DATASET}[test]"), ByteTokenizer())
    for flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(flag, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", CLOSED)
    start = time.monotonic()
    check_hub_dataset(DATASET, cache_dir=str(cache))  # the hub out of reach: the cache serves
    assert time.monotonic() - start < 1


@pytest.mark.parametrize("setting", [f"data.tokenizer={TOKENIZER}", f"data.source={DATASET}"])
def test_finetune_says_it_in_one_line_within_seconds(tmp_path, setting):
    """A fresh process, as a user runs it: huggingface_hub reads its settings when imported."""
    start = time.monotonic()
    env = {**unreachable_env(tmp_path / "hf"), "XDG_CACHE_HOME": str(tmp_path / "c")}  # no data
    done = subprocess.run([sys.executable, "-m", "lctrain", "finetune", "--set", setting,
                           "--set", "parallel.cp=1", "--nproc", "1", "--output-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    key, name = setting.split("=")
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not read the "), done.stderr
    assert f"'{name}' ({key}): it is a hub name, but the hub {CLOSED} cannot be" in lines[0]
    assert time.monotonic() - start < 20  # start-up and one refused probe, not the retries
