"""The parked layers' pinned host memory is checked before training starts (running out of it
ends in the kernel's OOM killer mid-step, with no message)."""
from __future__ import annotations

import pytest
import torch

from lctrain.config import load_recipe
from lctrain.errors import UserError
from lctrain.memory import estimate_recipe
from lctrain.memory.host import check_host_memory
from lctrain.launch.launcher import check_before_start

GIB = 1 << 30


@pytest.fixture
def cuda_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


def _parked(cfg, gpus=2):
    return estimate_recipe(cfg, seq_len=cfg.data.seq_len, gpus=gpus,
                           gpu_memory=80 * GIB).details["host_offload"]


def test_too_little_host_memory_is_one_clear_error(cuda_machine):
    cfg = load_recipe("llama-7b-256k", seq_len="512k")
    parked = _parked(cfg)
    assert parked > 100 * GIB  # every GPU parks every layer's input and attention output
    with pytest.raises(UserError, match=r"train.offload layers at data.seq_len 524288 parks about \d+ "
                                        r"GiB .* 2 processes .* only 200 GiB is available"):
        check_host_memory(cfg, local_processes=2, gpus=2, available=200 * GIB)
    check_host_memory(cfg, local_processes=1, gpus=2, available=int(parked / 0.85))


def test_only_parked_layers_on_gpus_are_checked(cuda_machine, monkeypatch, tmp_path):
    cfg = load_recipe("llama-7b-256k", ["train.offload=none"], seq_len="512k")
    check_host_memory(cfg, local_processes=8, gpus=8, available=1 * GIB)
    cfg = load_recipe("llama-7b-256k", ["train.host_memory=1GiB"], seq_len="512k",
                      output_dir=str(tmp_path))
    with pytest.raises(UserError, match="only 1 GiB is available"):
        check_before_start(cfg, nproc=8, resume=False)  # what the launcher checks on GPUs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="this CPU run needs about"):  # it pins nothing, but the
        check_before_start(cfg, nproc=2, resume=False)  # whole training state is host memory


def test_more_processes_than_gpus_are_refused_and_than_cores_warned(cuda_machine, monkeypatch,
                                                                  tmp_path, capsys):
    cfg = load_recipe(None, ["parallel.cp=1"], output_dir=str(tmp_path))
    with pytest.raises(UserError, match=r"^9 processes need 9 GPUs, and this machine shows 8 "
                                        r"\(CUDA_VISIBLE_DEVICES included\); use --nproc 8"):
        check_before_start(cfg, nproc=9, resume=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    check_before_start(cfg, nproc=2, resume=False)
    assert capsys.readouterr().err == ""
    check_before_start(cfg, nproc=3, resume=False)
    assert capsys.readouterr().err == ("warning: 3 processes share 2 CPU cores and take turns "
                                       "on them, which slows every step\n")


def test_declared_host_memory_replaces_what_the_machine_reports(cuda_machine, monkeypatch):
    """VMs whose memory grows as it is used report too little: train.host_memory says how much."""
    import lctrain.memory.host as host

    monkeypatch.setattr(host, "available_host_bytes", lambda: 31 * GIB)
    cfg = load_recipe("llama-7b-256k", seq_len="384k")
    with pytest.raises(UserError, match="only 31 GiB is available.*train.host_memory"):
        check_host_memory(cfg, local_processes=2, gpus=2)
    big = load_recipe("llama-7b-256k", ["train.host_memory=251GiB"], seq_len="384k")
    assert big.train.host_memory == 251 * GIB
    check_host_memory(big, local_processes=2, gpus=2)
    with pytest.raises(UserError, match="only 120 GiB"):
        check_host_memory(load_recipe("llama-7b-256k", ["train.host_memory=120GiB"],
                                      seq_len="384k"), local_processes=2, gpus=2)


@pytest.mark.parametrize("value, message", [("lots", "train.host_memory"),
                                            ("-5", "must be positive"), ("0", "must be positive")])
def test_bad_host_memory_is_one_clear_error(value, message):
    from lctrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_recipe("llama-7b-256k", [f"train.host_memory={value}"])
