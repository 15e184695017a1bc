"""A model given by hub name that the local hub cache holds loads from the cache at once when the
hub cannot be reached (and offline mode is not set): config, weights and tokenizer, where
transformers alone would retry the hub for about 20 s per file first. Nothing here needs the
network: the hub is a closed port on this machine, the cache a temporary folder."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from model_folders import TOKENIZER_VOCAB, make_model_folder

NAME = "someone/tiny-llama"
CLOSED = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused


def hub_cache_copy(folder: Path, hf_home: Path, name: str, kind: str = "models") -> Path:
    """Copy ``folder`` into ``hf_home/hub`` as the hub's cache holds a download of ``name``
    (``models--owner--name/snapshots/<commit>``, with refs/main naming the commit)."""
    repo = hf_home / "hub" / f"{kind}--{name.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return repo / "snapshots" / "0123abcd"


def unreachable_env(hf_home: Path) -> dict[str, str]:
    """This environment with the hub a closed local port, offline mode off and ``hf_home`` as
    the Hugging Face home (its hub cache under hub/)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
                        "HF_HUB_CACHE", "HF_DATASETS_CACHE")}
    env.update(HF_ENDPOINT=CLOSED, HF_HOME=str(hf_home),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent),
                                           env.get("PYTHONPATH", "")]))
    return env


_LOAD = """
import json, sys, time
import torch
from safetensors.torch import load_file
from lctrain.config import load_recipe
from lctrain.data import load_tokenizer
from lctrain.model import load_model

name, weights = sys.argv[1], sys.argv[2]
start = time.monotonic()
cfg = load_recipe(None, [f"model.path={name}", "model.config=null", "data.tokenizer=null"])
model = load_model(name, config=None, seed=0)
tokenizer = load_tokenizer(cfg)
elapsed = time.monotonic() - start
state = model.state_dict()
saved = load_file(weights)
same = sorted(state) == sorted(saved) and all(torch.equal(state[k], v) for k, v in saved.items())
print(json.dumps({"seconds": elapsed, "same": same, "tokens": len(tokenizer),
                  "text": tokenizer.decode(tokenizer.encode("cached at once"))}))
"""


def test_a_cached_hub_model_loads_at_once_when_the_hub_is_unreachable(tmp_path):
    folder = make_model_folder(tmp_path, "llama3", name="source")
    snapshot = hub_cache_copy(folder, tmp_path / "hf", NAME)
    done = subprocess.run([sys.executable, "-c", _LOAD, NAME, str(snapshot / "model.safetensors")],
                          env=unreachable_env(tmp_path / "hf"), capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"], "the model did not come from the cached weights"
    assert result["tokens"] == TOKENIZER_VOCAB  # the cached tokenizer, not another
    assert "cached at once" in result["text"]
    assert "Retrying" not in done.stderr, done.stderr
    assert result["seconds"] < 6, result  # one refused probe, not transformers' retries
