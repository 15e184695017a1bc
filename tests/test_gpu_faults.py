"""Faults and resume on two GPUs over NCCL (``pytest -m gpu``; skipped without two GPUs), the
embedded tiny recipe as a user starts it:

- a run at dp 1 × cp 2 on two GPUs, resumed from its step-2 checkpoint on one GPU (cp 1, the
  GPU picked with CUDA_VISIBLE_DEVICES), gives the uninterrupted run's losses of steps 3–4 —
  the model and AdamW states resharded from the two ranks' DCP files;
- SIGSTOP on rank 1 of a run: rank 0's watchdog names rank 1 after train.collective_timeout,
  and, when rank 0 waits in an NCCL collective, torch's NCCL timeout dumps its flight recorder
  (its last collectives) beside the run's other launch files;
- a run stopped by non-finite steps names the checkpoint its last background save wrote.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fault_tools import leftovers
from lctrain.checkpoint.reader import list_checkpoints
from lctrain.config import load_recipe
from lctrain.errors import UserError
from lctrain.train import finetune

pytestmark = pytest.mark.gpu
EXACT = ("train.mixed_precision=no", "parallel.attention_backend=reference")  # fp32, no TF32


@pytest.fixture(autouse=True)
def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def _finetune(*args: str, gpus: str = "0,1") -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    run = subprocess.run([sys.executable, "-m", "lctrain", "finetune", *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-1500:]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_on_two_gpus_resumes_on_one_gpu(tmp_path):
    sets = [f"--set={s}" for s in (*EXACT, "checkpoint.every=2", "checkpoint.keep=2",
                                   "checkpoint.export_final=false")]
    two = tmp_path / "two"
    _finetune("--max-steps", "4", "--output-dir", str(two), "--set", "parallel.cp=2", *sets)
    one = tmp_path / "one"
    (one / "checkpoints").mkdir(parents=True)
    shutil.copy(two / "config.yaml", one / "config.yaml")
    shutil.copytree(two / "checkpoints" / "step-00000002", one / "checkpoints" / "step-00000002")
    _finetune("--output-dir", str(one), "--resume", "--set", "parallel.cp=1", gpus="1")
    straight, resumed = _metrics(two), _metrics(one)
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(straight[2:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["lr"] == a["lr"]


def _beat(out: Path, rank: int) -> dict:
    try:
        return json.loads((out / ".launch" / "ranks" / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_stopped_rank_on_two_gpus_is_named_and_nccl_dumps_its_collectives(tmp_path):
    out = tmp_path / "hang"
    cfg = load_recipe(None, ["parallel.cp=2", "train.collective_timeout=10",
                             "checkpoint.keep=0", *EXACT], output_dir=str(out),
                      max_steps=100_000)
    stopped = {}

    def freeze():
        deadline = time.monotonic() + 240
        while not all(_beat(out, r).get("step", 0) >= 3 for r in (0, 1)):
            assert time.monotonic() < deadline, "the run never reached step 3"
            time.sleep(0.05)
        stopped["pid"] = _beat(out, 1)["pid"]
        os.kill(stopped["pid"], signal.SIGSTOP)
        stopped["at"] = time.monotonic()

    thread = threading.Thread(target=freeze, daemon=True)
    thread.start()
    with pytest.raises(UserError) as error:
        finetune(cfg, nproc=2)
    thread.join()
    assert time.monotonic() - stopped["at"] < 10 + 120
    message = str(error.value)
    waited = re.match(r"rank 0 waited (\d+) s in the ", message)
    assert waited and 10 <= int(waited[1]) <= 15, message  # the timeout, plus the beat's delay
    assert f"these ranks did not arrive: rank 1 (pid {stopped['pid']} " in message, message
    cmdline = Path(f"/proc/{stopped['pid']}/cmdline")  # the launcher ended the stopped rank
    assert not cmdline.exists() or not cmdline.read_bytes()
    if "the stop-signal check" in message:  # rank 1 stopped between steps: rank 0 waits on
        return  # gloo with no NCCL collective pending, so NCCL has nothing to time out and dump
    trace = out / ".launch" / "nccl_trace_rank_0"
    assert trace.is_file(), (message, sorted(p.name for p in (out / ".launch").iterdir()))
    dump = pickle.loads(trace.read_bytes())
    assert dump["entries"] and all("profiling_name" in e for e in dump["entries"])


def test_a_diverged_run_on_two_gpus_names_the_checkpoint_its_background_save_lands(tmp_path):
    """Checkpoints on GPUs are written in the background; the run that stops on non-finite
    steps waits for the save in flight and names the newest checkpoint, none left half-written."""
    out = tmp_path / "nan"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
    run = subprocess.run([sys.executable, "-m", "lctrain", "finetune", "--max-steps", "12",
                          "--output-dir", str(out), "--set", "train.lr=1e10",
                          "--set", "train.max_nonfinite_steps=3", "--set", "checkpoint.every=1",
                          "--set", "checkpoint.keep=1"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1, run.stdout[-1500:] + run.stderr[-1500:]
    saved = list_checkpoints(out / "checkpoints")
    step, path = saved[-1]
    assert run.stderr.rstrip().endswith(
        f"the last complete checkpoint is {path} (step {step}); resume with: lctrain finetune "
        f"{out / 'config.yaml'} --resume."), run.stderr[-1500:]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert not leftovers(out)
