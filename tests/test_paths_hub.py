"""A model given by hub name that neither the hub nor its local cache can give is refused at once,
in one sentence: offline mode without a probe, an unreachable hub after one short probe (where
transformers would retry for about 20 s). Nothing here needs the network: the hub is a closed
port on this machine, or a local server that answers 404."""
from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.errors import ConfigError
from test_hub_cache import CLOSED

NAME = "meta-llama/Llama-3.1-8B"
HUB_RECIPE = ["--set", f"model.path={NAME}", "--set", "model.config=null",
              "--set", "data.tokenizer=null"]


def _error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_offline_mode_refuses_a_hub_name_at_once(empty_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for args in (["finetune", *HUB_RECIPE, "--output-dir", str(tmp_path / "run")],
                 ["estimate-memory", "--model", NAME, "--seq-len", "128k"]):
        start = time.monotonic()
        line = _error_line(CliRunner().invoke(app, args))
        assert time.monotonic() - start < 2, args
        what = "--model" if "--model" in args else "model.path"
        assert line.startswith(f"error: could not read the config of model '{NAME}' ({what}): "
                               "it is a hub name, but HF_HUB_OFFLINE is set (offline mode) and "
                               f"the local hub cache ({empty_cache}) does not hold it; "), line
        assert line.count(". ") == 0 and not (tmp_path / "run").exists()


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """This environment without offline mode, its hub a closed local port, its caches empty."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    env.update(HF_ENDPOINT=CLOSED, HF_HOME=str(tmp_path / "hf"))
    return env


@pytest.mark.parametrize("args", [
    ["finetune", *HUB_RECIPE, "--nproc", "1"],
    ["estimate-memory", "--model", NAME, "--seq-len", "128k"],
])
def test_an_unreachable_hub_is_one_sentence_within_seconds(tmp_path, args):
    """A fresh process, as a user runs it: huggingface_hub reads its settings when imported."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lctrain", *args, "--output-dir",
                           str(tmp_path / "run")] if args[0] == "finetune"
                          else [sys.executable, "-m", "lctrain", *args],
                          env=_clean_env(tmp_path), capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr
    what = "--model" if "--model" in args else "model.path"
    assert done.stderr.splitlines() == [
        f"error: could not read the config of model '{NAME}' ({what}): it is a hub name, but "
        f"the hub {CLOSED} cannot be reached from this machine and the local hub cache "
        f"({tmp_path / 'hf' / 'hub'}) does not hold it; point {what} at a local model folder, "
        "or run where the hub can be reached"
        + (f" (from --set model.path={NAME})" if what == "model.path" else "")], done.stderr
    assert elapsed < 8, elapsed  # startup and one refused probe, not transformers' retries


def test_a_cached_name_and_a_hub_that_answers_pass(empty_cache, monkeypatch):
    """A cached name passes without asking the hub, and transformers is told to read the cache
    alone while the hub does not answer; a hub that answers (404 too) is asked once, with one
    HEAD request, and transformers may ask it."""
    from lctrain.config import hub
    from lctrain.config.hub import cache_only, check_hub_model

    probes = []
    answers = hub._answers
    monkeypatch.setattr(hub, "_answers", lambda url, timeout: probes.append(url) or answers(
        url, timeout))
    hub.hub_answers.cache_clear()  # asked once per process: from here on, by this test
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", CLOSED)
    with pytest.raises(ConfigError, match="cannot be reached"):
        check_hub_model(NAME)
    assert probes == [CLOSED]
    snapshot = empty_cache / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    assert check_hub_model(NAME) is None  # in the cache: no new probe ...
    assert cache_only(NAME) and probes == [CLOSED]  # ... and transformers reads it from there
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_hub_model(NAME) is None and cache_only(NAME)  # offline mode too
    assert probes == [CLOSED]

    heads = []

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - the standard library's name
            heads.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        assert check_hub_model("someone/not-cached") is None  # the hub answers (404 too) ...
        assert not cache_only("someone/not-cached")  # ... so transformers asks it
        assert probes == [CLOSED, endpoint] and heads == ["/"]  # one probe, one HEAD request
    finally:
        server.shutdown()
        server.server_close()
        hub.hub_answers.cache_clear()
