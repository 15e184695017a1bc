"""Loss masks through whole training runs on two gloo ranks (the runner, the tiny model).

- prompts of random bytes ending in "|", every completion "ok": trained on the completion only,
  the reported loss falls near zero within a few dozen steps — impossible if the random prompt
  bytes were targets (they cost about ln 94 nats each);
- the same masked rows at cp = 2 (distflash), cp = 2 (zigzag) and dp = 2 give the same losses;
- rows whose every label is masked (a prompt longer than a row, split) give a loss of 0, not NaN,
  and ``train.epochs`` stops the run at the step the epochs make.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from lctrain.config import load_recipe
from spawn import run_on_ranks


def _prompt_completion(path: Path, n: int, rng: random.Random) -> Path:
    alphabet = [chr(c) for c in range(32, 127) if chr(c) != "|"]
    lines = [json.dumps({"prompt": "".join(rng.choice(alphabet) for _ in range(rng.randint(10, 40)))
                         + "|", "completion": "ok"}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(out: Path, source: Path, **sets):
    base = {"data.source": str(source), "data.seq_len": 128, "train.warmup_steps": 2,
            "train.loss_chunk_tokens": 64, "train.lr": 1e-2, "train.min_lr_ratio": 1.0, "parallel.attention_backend": "reference",
            "parallel.cp": 2, "train.grad_accum": 2, "parallel.fsdp": "off", "train.max_steps": 3,
            "checkpoint.keep": 0}
    base.update(sets)
    return load_recipe(None, [f"{k}={v}" for k, v in base.items()], output_dir=str(out))


def _run_all(rank, world, cfgs):
    from lctrain.train.runner import run_worker

    out = []
    for cfg in cfgs:
        assert run_worker(cfg) == 0
        path = Path(cfg.train.output_dir) / "metrics.jsonl"
        out.append([json.loads(x) for x in path.read_text().splitlines()] if rank == 0 else None)
    return out


@pytest.mark.slow
def test_masked_training_on_two_ranks(tmp_path):
    rng = random.Random(random.randrange(2**31))
    pc = _prompt_completion(tmp_path / "pc.jsonl", 200, rng)
    long_prompt = tmp_path / "long.jsonl"  # one sample of 4 rows, the first three all prompt
    long_prompt.write_text(json.dumps({"prompt": "x" * 400, "completion": "done"}) + "\n")
    cfgs = [
        _cfg(tmp_path / "learn", pc, **{"train.max_steps": 30}),
        _cfg(tmp_path / "zigzag", pc, **{"parallel.schedule": "zigzag"}),
        _cfg(tmp_path / "dp2", pc, **{"parallel.cp": 1, "train.grad_accum": 1}),
        _cfg(tmp_path / "epochs", long_prompt, **{"data.long_samples": "split",
                                                  "train.max_steps": "null", "train.epochs": 1.5,
                                                  "train.grad_accum": 1}),
    ]
    learn, zigzag, dp2, epochs = run_on_ranks(_run_all, 2, cfgs)[0]
    losses = [r["loss"] for r in learn]
    assert losses[0] > 3.0, losses
    assert losses[-1] < 0.02, losses  # only the completion is trained on
    for a, b, c in zip(learn, zigzag, dp2):  # same rows per step, same masked labels
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert c["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert c["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    # 4 rows (401 + 5 + bos + eos = 411 tokens at 128 a row), 1 row a step: 1.5 epochs = 6 steps
    assert [r["step"] for r in epochs] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in epochs)
    assert sum(r["loss"] == 0.0 for r in epochs) >= 3  # rows with no target: loss 0, no NaN
