"""W&B and MLflow through train.report_to, on a real one-process CPU run (the worker runs in the
test process): the offline W&B run and the local MLflow store hold the same scalars as
metrics.jsonl at the same steps, and the recipe as their config; a --resume logs on into the
same tracker runs; a missing package or a tracker that cannot start is one sentence. Nothing
reaches the network: W&B is offline, MLflow writes files, and this process may open no
connection off the machine.
"""
from __future__ import annotations

import json
import socket
import struct
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lctrain.cli import app
from lctrain.train.tracking import SCALARS, TRACKER_IDS

RUN = ["finetune", "--nproc", "1", "--set", "parallel.cp=1", "--seq-len", "64",
       "--set", "train.warmup_steps=0", "--set", "checkpoint.keep=1",
       "--set", "checkpoint.export_final=false"]
"""A tiny one-process run that keeps its last checkpoint."""


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, MLflow on a file store, both under tmp_path; no connection leaves the host."""
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_CONFIG_DIR": tmp_path / "wandb-config", "WANDB_CACHE_DIR": tmp_path / "cache",
           "WANDB_DATA_DIR": tmp_path / "data", "MLFLOW_ALLOW_FILE_STORE": "true",
           "MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
                 "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    connect = socket.socket.connect

    def local_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
                "127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"a connection to {address} was tried")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    return tmp_path


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _wandb_records(path: Path):
    """The records of one offline W&B run file, read with W&B's own record schema (the file is
    LevelDB's log format: a 7-byte header, then 32 KiB blocks of chunks, each with a 7-byte
    header of checksum, length and kind: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, pending = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if room < 7 or (kind == 0 and length == 0):  # block padding
            pos += room
            continue
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_logged(run: Path) -> tuple[set[str], dict[str, dict[int, float]], dict]:
    """Run ids, {tag: {step: value}} and the config of the offline W&B runs in ``run``."""
    ids, series, config = set(), {}, {}
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "config":
                config.update({i.key or ".".join(i.nested_key): json.loads(i.value_json)
                               for i in record.config.update})
            elif kind == "history":
                items = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                for tag, value in items.items():
                    if not tag.startswith("_"):
                        series.setdefault(tag, {})[items["_step"]] = value
    return ids, series, config


def _expected(run: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of metrics.jsonl (the independent record of what was logged)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    series = {tag: {r["step"]: r[key] for r in records if r.get(key) is not None}
              for key, tag in SCALARS.items()}
    series["perf/peak_memory_gib"] = {r["step"]: r["peak_memory_bytes"] / (1 << 30)
                                      for r in records}
    return {tag: values for tag, values in series.items() if values}


def test_wandb_and_mlflow_hold_the_metrics_and_a_resume_continues_them(offline):
    from mlflow.tracking import MlflowClient

    run = offline / "tiny-run"
    args = [*RUN, "--set", "train.report_to=[jsonl,wandb,mlflow]", "--output-dir", str(run)]
    code, output = _invoke(*args, "--max-steps", "2")
    assert code == 0, output
    first = json.loads((run / TRACKER_IDS).read_text())
    code, output = _invoke(*args, "--max-steps", "4", "--resume")
    assert code == 0, output
    ids = json.loads((run / TRACKER_IDS).read_text())
    assert ids == first  # the same tracker runs, continued

    expected = _expected(run)
    assert sorted(expected["train/loss"]) == [1, 2, 3, 4] and "train/lr" in expected
    client = MlflowClient()
    mlflow_run = client.get_run(ids["mlflow"])
    assert mlflow_run.info.run_name == "tiny-run"
    assert client.get_experiment(mlflow_run.info.experiment_id).name == "lctrain"
    assert mlflow_run.data.params["data.seq_len"] == "64"
    assert mlflow_run.data.params["train.report_to"] == str(["jsonl", "wandb", "mlflow"])
    for tag, values in expected.items():
        assert {m.step: m.value for m in client.get_metric_history(ids["mlflow"], tag)} == values

    wandb_ids, series, config = _wandb_logged(run)
    assert wandb_ids == {ids["wandb"]} and len(list(run.glob("wandb/offline-run-*"))) == 2
    assert series == expected
    assert config["data.seq_len"] == 64 and config["train.max_steps"] == 4  # as resumed


def test_a_fresh_start_begins_new_tracker_runs(offline):
    run = offline / "again"
    args = [*RUN, "--set", "train.report_to=[wandb,mlflow]", "--set", "checkpoint.keep=0",
            "--max-steps", "1", "--output-dir", str(run)]
    assert _invoke(*args)[0] == 0
    first = json.loads((run / TRACKER_IDS).read_text())
    assert _invoke(*args)[0] == 0  # a finished run's folder, started again from scratch
    second = json.loads((run / TRACKER_IDS).read_text())
    assert first.keys() == second.keys() == {"wandb", "mlflow"}
    assert all(first[name] != second[name] for name in first)
    assert not (run / "metrics.jsonl").exists()  # jsonl was not asked for


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_package_is_one_sentence_before_any_process(name, tmp_path, monkeypatch):
    from lctrain.launch import launcher

    monkeypatch.setitem(sys.modules, name, None)  # not importable, as when not installed
    started = []
    monkeypatch.setattr(launcher, "dispatch", lambda *a, **kw: started.append(a) or 0)
    code, output = _invoke(*RUN, "--set", f"train.report_to=[jsonl,{name}]",
                           "--output-dir", str(tmp_path / "run"))
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert (f"train.report_to asks for {name} but the {name} package is not installed; "
            f"pip install {name}, or drop {name} from train.report_to") in errors[0]
    assert not started and not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_is_one_sentence(offline, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuch://tracker")  # a store MLflow lacks
    code, output = _invoke(*RUN, "--set", "train.report_to=[jsonl,mlflow]", "--max-steps", "1",
                           "--output-dir", str(offline / "run"))
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert "train.report_to asks for mlflow but its run did not start (" in errors[0]
    assert "nosuch://tracker" in errors[0] and not (offline / "run" / TRACKER_IDS).exists()


def test_a_tracker_that_fails_mid_run_is_dropped_and_training_goes_on(offline, capsys):
    """The MLflow run's store vanishes after step 1: step 2 warns once and the tracker is
    dropped; nothing raises, and later steps are not tried on it."""
    import shutil

    from mlflow.tracking import MlflowClient

    from lctrain.config import load_recipe
    from lctrain.train.tracking import Tracking

    cfg = load_recipe(None, ["train.report_to=[jsonl,mlflow]",
                             f"train.output_dir={offline / 'run'}"])
    (offline / "run").mkdir()  # made by the run before its trackers start
    tracking = Tracking(cfg, enabled=True, resume_step=None)
    run_id = json.loads((offline / "run" / TRACKER_IDS).read_text())["mlflow"]
    tracking.write({"step": 1, "loss": 2.5})
    assert [m.value for m in MlflowClient().get_metric_history(run_id, "train/loss")] == [2.5]
    shutil.rmtree(offline / "mlruns")
    tracking.write({"step": 2, "loss": 2.0})
    tracking.write({"step": 3, "loss": 1.5})
    tracking.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "mlflow" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: mlflow stopped taking "
                                                         "metrics at step 2 (")
    assert [json.loads(line)["loss"] for line in (offline / "run" / "metrics.jsonl").open()] == \
        [2.5, 2.0, 1.5]


def test_a_gpu_record_gives_its_memory_peaks_in_gib_and_drops_what_is_not_finite():
    """A GPU step's record: every scalar of `SCALARS` it has, its allocated and reserved peaks in
    GiB; a missing MFU (unknown GPU) or a NaN loss gives no point."""
    import torch

    from lctrain.train.tracking import scalars

    peak, reserved = (int(n) for n in torch.randint(1, 1 << 40, (2,)))  # the run's seed
    record = {"step": 3, "loss": float("nan"), "lr": 1e-4, "mfu": None, "alloc_retries": 2,
              "peak_memory_bytes": peak, "peak_reserved_bytes": peak + reserved}
    assert scalars(record) == {"train/lr": 1e-4, "perf/alloc_retries": 2.0,
                               "perf/peak_memory_gib": peak / 2**30,
                               "perf/peak_reserved_gib": (peak + reserved) / 2**30}
