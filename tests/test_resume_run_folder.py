"""``--resume`` through the command line, from a real run's folder (one CPU process, tiny model):

- the run's own config.yaml is the recipe: ``--output-dir R --resume`` alone continues it, a
  setting that may change (``--max-steps``) changes and is said, any other is refused naming
  both values, and a fresh run into R (or into a folder of another run) is refused;
- the saved recipe has absolute paths and the files ordinary permissions;
- nothing in the folder is unpickled: a tampered ``.metadata``, RNG file, DCP data file, a
  metadata that declares a pickled entry, a planted ``trainer.pt`` or a YAML tag that calls a
  function never run code on ``--resume``, ``export`` or ``eval`` (a marker file stays absent); each
  tampering is one sentence and exit code 1, or ignored.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lctrain.cli import app


class _Evil:
    """Unpickling this runs a shell command (what a tampered file would carry)."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return os.system, (f"touch {self.mark}",)


def _cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback: a bug
    return result.exit_code, result.output


def _one_sentence(code: int, output: str) -> str:
    assert code == 1, output
    lines = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, output
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 2-step run (checkpoint at step 2) of the tiny recipe on one process."""
    parent = tmp_path_factory.mktemp("runs")
    cwd = os.getcwd()
    os.chdir(parent)  # a relative --output-dir: the saved recipe must name it absolutely
    try:
        code, output = _cli("finetune", "--nproc", 1, "--set", "parallel.cp=1", "--seq-len", 64,
                            "--max-steps", 2, "--set", "data.max_documents=8",
                            "--set", "train.warmup_steps=1",
                            "--set", "checkpoint.export_final=false", "--output-dir", "run")
    finally:
        os.chdir(cwd)
    assert code == 0, output
    return parent / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    """The run folder moved elsewhere (it is still its run)."""
    shutil.copytree(run, tmp_path / "copy")
    return tmp_path / "copy"


def test_resume_takes_the_runs_recipe_and_refuses_what_may_not_change(run, tmp_path):
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["output_dir"] == str(run)
    assert stat.S_IMODE((run / "config.yaml").stat().st_mode) == 0o666 & ~_umask()
    for file in (run / "checkpoints" / "step-00000002").iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~_umask(), file
    error = _one_sentence(*_cli("finetune", "--output-dir", run, "--resume", "--seq-len", 128))
    assert "cannot change data.seq_len" in error and "64" in error and "128" in error
    error = _one_sentence(*_cli("finetune", "--output-dir", run, "--resume",
                                "--set", "train.lr=1e-2"))
    assert "cannot change train.lr" in error and "0.003" in error and "0.01" in error
    error = _one_sentence(*_cli("finetune", "--output-dir", run, "--max-steps", 3))
    assert "holds another run" in error  # a fresh run never writes into another run's folder
    error = _one_sentence(*_cli("finetune", "--output-dir", tmp_path / "none", "--resume"))
    assert "no run to resume" in error
    copy = _copy(run, tmp_path)
    (copy / "checkpoints" / "step-00000002" / "trainer.pt").write_bytes(
        pickle.dumps(_Evil(tmp_path / "PWNED")))  # an older format's file: never read
    code, output = _cli("finetune", "--output-dir", copy, "--resume", "--max-steps", 3,
                        "--nproc", 1)
    assert code == 0, output
    assert "resuming with changed settings: train.max_steps 2 -> 3" in output
    assert "resuming at step 2" in output and not (tmp_path / "PWNED").exists()
    assert yaml.safe_load((copy / "config.yaml").read_text())["train"]["max_steps"] == 3


def test_a_copied_run_resumed_from_its_config_continues_the_copy_only(run, tmp_path):
    original = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    copy = _copy(run, tmp_path)
    code, output = _cli("finetune", copy / "config.yaml", "--resume", "--max-steps", 3,
                        "--nproc", 1)
    assert code == 0, output
    assert "resuming at step 2" in output
    assert [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text()
            .splitlines()] == [1, 2, 3]  # the copy's log goes on
    assert (copy / "checkpoints" / "step-00000003").is_dir()
    assert yaml.safe_load((copy / "config.yaml").read_text())["train"]["output_dir"] == str(copy)
    after = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    assert after == original  # the original run is not touched


def test_a_start_that_failed_before_its_first_step_is_taken_over(tmp_path):
    bad = tmp_path / "bad.jsonl"
    # the launcher checks the first 8 records; the 10th fails in the ranks, after config.yaml
    bad.write_text('{"text": "a good record"}\n' * 9 + '{"body": "no text field here"}\n')
    common = ["--nproc", 1, "--set", "parallel.cp=1", "--seq-len", 64, "--max-steps", 1,
              "--set", "checkpoint.export_final=false", "--output-dir", tmp_path / "run"]
    code, output = _cli("finetune", *common, "--set", f"data.source={bad}")
    assert code != 0 and (tmp_path / "run" / "config.yaml").exists(), output
    code, output = _cli("finetune", *common, "--set", "data.max_documents=8")
    assert code == 0, output
    assert "never completed a step; this run takes the folder over" in output
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["data"]["source"] == "builtin"
    code, output = _cli("finetune", *common, "--set", "data.max_documents=4")
    assert "holds another run" in _one_sentence(code, output)  # a run that trained is kept


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _tamper_metadata(path: Path, evil: bytes) -> None:
    (path / ".metadata").write_bytes(evil)


def _tamper_rng(path: Path, evil: bytes) -> None:
    (path / "rng-rank0.safetensors").write_bytes(evil)


def _tamper_data(path: Path, evil: bytes) -> None:
    blob = io.BytesIO()
    torch.save(_EvilBox(evil), blob)
    (path / "__0_0.distcp").write_bytes(blob.getvalue())


def _tamper_bytes_entry(path: Path, evil: bytes) -> None:
    """Declare a weight a pickled ("bytes") entry that points at a payload."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from lctrain.checkpoint.safe_load import load_metadata

    metadata = load_metadata((path / ".metadata").read_bytes(), "test")
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn != key}
    (path / "payload.distcp").write_bytes(evil)
    metadata.storage_data[MetadataIndex(key)] = _StorageInfo("payload.distcp", 0, len(evil))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


class _EvilBox:
    """A torch.save payload that unpickles into a shell command."""

    def __init__(self, evil: bytes) -> None:
        self.evil = evil

    def __reduce__(self):
        return pickle.loads, (self.evil,)


def _tamper_config(run_dir: Path, mark: Path) -> None:
    text = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(
        text + f"extra: !!python/object/apply:os.system ['touch {mark}']\n")


@pytest.mark.parametrize("tamper, words", [
    (_tamper_metadata, "refusing to load posix.system"),
    (_tamper_rng, "is not an RNG state lctrain wrote"),
    (_tamper_data, "cannot be loaded into this model"),
    (_tamper_bytes_entry, "is a pickled object"),
    ("config", "not valid YAML"),
])
def test_a_tampered_run_folder_runs_no_code(run, tmp_path, tamper, words):
    mark = tmp_path / "PWNED"
    evil = pickle.dumps(_Evil(mark))
    copy = _copy(run, tmp_path)
    if tamper == "config":
        _tamper_config(copy, mark)
    else:
        tamper(copy / "checkpoints" / "step-00000002", evil)
    error = _one_sentence(*_cli("finetune", "--output-dir", copy, "--resume", "--max-steps", 3,
                                "--nproc", 1))
    assert words in error
    if tamper in (_tamper_metadata, "config"):  # export reads the metadata and the recipe
        error = _one_sentence(*_cli("export", copy, "--output", tmp_path / "out"))
        assert words in error
    if tamper in (_tamper_metadata, _tamper_data, _tamper_bytes_entry):  # eval loads the weights
        error = _one_sentence(*_cli("eval", copy, "--cp", 1, "--max-rows", 1))
        assert words in error
    assert not mark.exists()
