"""Every bad input of the README's troubleshooting table, through the command line: one sentence
that names the file, line or setting, exit code 1, no traceback — before any process starts
where the mistake can be seen there (the data ones surface in the one in-process worker, before
the model is built). Inputs that are not mistakes but lose something (records with nothing to
train on, samples longer than a row, a warm-up longer than the run) are counted and said.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fault_tools import fill

from lctrain.cli import app

RUN = ["finetune", "--nproc", "1", "--set", "parallel.cp=1", "--seq-len", "64", "--max-steps",
       "1", "--set", "train.warmup_steps=0", "--set", "checkpoint.keep=0"]
"""A one-step, one-process tiny run (the worker runs inside the test process)."""


def _files(root: Path) -> dict[str, str]:
    """The bad files, written fresh; name -> path."""
    text = {"bad.jsonl": '{"text": "hello world"}\n{bad\n',
            "missing.jsonl": '{"text": "hello"}\n{"other": "x"}\n',
            "number.jsonl": '{"text": "hello"}\n{"text": 5}\n',
            "list.jsonl": '{"text": "hello"}\n{"text": ["a", "b"]}\n',
            "mapping.jsonl": '{"text": "hello"}\n{"text": {"a": "b"}}\n',
            "empty_docs.jsonl": '{"text": ""}\n{"text": ""}\n',
            "zero.jsonl": "",
            "objects.jsonl": "{}\n{}\n",
            "null.jsonl": '{"text": "hello there"}\n{"text": null}\n',
            "long.jsonl": json.dumps({"prompt": "q", "completion": "x" * 500}) + "\n"
                          + json.dumps({"prompt": "q", "completion": "short"}) + "\n",
            "dup.yaml": "model:\n  config: {model_type: llama}\ntrain:\n  lr: 1e-3\n  lr: 2e-3\n",
            "broken/config.json": "{not json",
            "typeless/config.json": '{"hidden_size": 64}',
            "nomodel/weights.txt": "x"}
    raw = {"nonutf8.jsonl": b'{"text": "hello"}\n{"text": "\xff\xfe"}\n',
           "nonutf8.txt": b"hello \xff there", "nonutf8.yaml": b"train:\n  lr: \xff\n"}
    paths = {}
    for name, content in [*text.items(), *raw.items()]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content) if isinstance(content, str) else path.write_bytes(content)
        paths[name] = str(path)
    (root / "mem.jsonl").symlink_to("/proc/self/mem")  # opens, then every read fails (EIO)
    paths["mem.jsonl"] = str(root / "mem.jsonl")
    for name in ("broken", "typeless", "nomodel"):
        paths[name] = str(root / name)
    return paths


def _src(name):
    return lambda f: [*RUN, "--set", f"data.source={f[name]}"]


def _model(name):
    return lambda f: [*RUN, "--set", "model.config=null", "--set", f"model.path={f[name]}",
                      "--set", "data.tokenizer=null"]


CASES = [  # (id, command from the files, words of the one sentence)
    ("bad JSON line", _src("bad.jsonl"), ["bad.jsonl:2 is not valid JSON"]),
    ("missing text field", _src("missing.jsonl"), ["missing.jsonl:2 has no 'text' field"]),
    ("number as text", _src("number.jsonl"), ["number.jsonl:2", "not a string"]),
    ("list as text", _src("list.jsonl"), ["list.jsonl:2", "is a list, not a string"]),
    ("mapping as text", _src("mapping.jsonl"), ["mapping.jsonl:2", "is a dict, not a string"]),
    ("non-UTF-8 JSON line", _src("nonutf8.jsonl"), ["nonutf8.jsonl:2 is not UTF-8", "0xff"]),
    ("non-UTF-8 text file", _src("nonutf8.txt"), ["nonutf8.txt:1 is not UTF-8", "column 7"]),
    ("only empty documents", _src("empty_docs.jsonl"),
     ["no token to train on", "empty document: 2", "empty_docs.jsonl:1"]),
    ("empty file", _src("zero.jsonl"), ["zero.jsonl", "holds no record"]),
    ("only empty objects", _src("objects.jsonl"),
     ["objects.jsonl has no field in any record", '{"text": "..."}']),
    ("unreadable file", _src("mem.jsonl"), ["could not read", "mem.jsonl", "Input/output error"]),
    ("source matches nothing", lambda f: [*RUN, "--set", "data.source=/nonexistent/*.jsonl"],
     ["matches no file"]),
    ("duplicate recipe key", lambda f: ["finetune", f["dup.yaml"]],
     ["dup.yaml", "line 5", "'lr' appears twice"]),
    ("non-UTF-8 recipe", lambda f: ["finetune", f["nonutf8.yaml"]],
     ["nonutf8.yaml is not UTF-8", "line 2, column 7"]),
    ("unknown recipe key", lambda f: ["finetune", "--set", "train.lrr=1"],
     ["unknown key train.lrr", "'train.lr'"]),
    ("broken model config", _model("broken"), ["broken/config.json:1 is not valid JSON"]),
    ("model config without model_type", _model("typeless"), ["config.json has no model_type"]),
    ("model folder without config", _model("nomodel"), ["nomodel", "has no config.json"]),
    ("model size zero", lambda f: [*RUN, "--set", "model.config.hidden_size=0"],
     ["model.config: hidden_size is 0", "positive"]),
    ("model size negative", lambda f: [*RUN, "--set", "model.config.num_hidden_layers=-1"],
     ["num_hidden_layers is -1"]),
    ("heads not dividing", lambda f: [*RUN, "--set", "model.config.num_attention_heads=3"],
     ["num_attention_heads 3 is not divisible by num_key_value_heads 2"]),
    ("unknown model type", lambda f: [*RUN, "--set", "model.config.model_type=foo"],
     ["model_type 'foo' is not a model type"]),
    ("seq_len zero", lambda f: ["finetune", "--seq-len", "0"], ["--seq-len must be positive"]),
    ("seq_len absurd", lambda f: ["finetune", "--seq-len", "64m", "--nproc", "2"],
     ["data.seq_len 67108864", "this CPU run needs about", "GiB available"]),
    ("seq_len the layout cannot split", lambda f: ["finetune", "--seq-len", "101"],
     ["data.seq_len 101 is not divisible by 2"]),
    ("cp larger than the processes", lambda f: ["finetune", "--nproc", "1"],
     ["world size 1 is not divisible by parallel.cp = 2"]),
    ("batch size zero", lambda f: ["finetune", "--set", "train.batch_size=0"],
     ["train.batch_size is 0"]),
    ("seed negative", lambda f: ["finetune", "--set", "train.seed=-1"],
     ["train.seed is -1", "4294967295"]),
    ("seed too large", lambda f: ["finetune", "--set", "train.seed=99999999999"],
     ["train.seed is 99999999999"]),
    ("output folder under a file", lambda f: [*RUN, "--output-dir", f["dup.yaml"] + "/run"],
     ["cannot be written (Not a directory)"]),
    ("output folder not creatable", lambda f: [*RUN, "--output-dir", "/proc/lctrain-run"],
     ["/proc/lctrain-run cannot be written"]),
    ("attention backend not installed",
     lambda f: [*RUN, "--set", "parallel.attention_backend=flash_attn_cute"],
     ["flash_attn_cute backend needs FlashAttention 4", "lctrain[fa4]"]),
    ("more GPUs per node than GPUs",
     lambda f: ["estimate-memory", "--gpus-per-node", "8", "--gpus", "2", "--seq-len", "4k"],
     ["--gpus-per-node 8 is more than the 2 GPUs"]),
    ("unknown schedule", lambda f: ["bench", "attention", "--schedule", "foo", "--seq-len", "256"],
     ["unknown schedule 'foo'"]),
    ("estimate with bad model size",
     lambda f: ["estimate-memory", "--set", "model.config.intermediate_size=0"],
     ["intermediate_size is 0"]),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    return _files(tmp_path_factory.mktemp("bad"))


def _invoke(args: list[str], cwd: Path) -> tuple[int, str]:
    if args[0] == "finetune" and "--output-dir" not in args:
        args = [*args, "--output-dir", str(cwd / "run")]
    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception  # a traceback
    return result.exit_code, result.output


@pytest.mark.parametrize("case, command, words", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_sentence(files, tmp_path, case, command, words):
    code, output = _invoke(command(files), tmp_path)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    for word in words:
        assert word in errors[0], errors[0]
    assert not list(tmp_path.glob("run/checkpoints/*"))


@pytest.mark.parametrize("source, words", [
    ("null.jsonl", ["1 skipped (empty document: 1, first at", "null.jsonl:2"]),
    ("long.jsonl", ["long samples: 1 longer than 64 tokens were left out", "long.jsonl:1"]),
])
def test_what_is_left_out_is_counted_and_said(files, tmp_path, source, words):
    code, output = _invoke([*RUN, "--set", f"data.source={files[source]}",
                            "--set", "train.warmup_steps=3"], tmp_path)
    assert code == 0, output
    for word in [*words, "warning: train.warmup_steps 3 is longer than the run (1 steps)"]:
        assert word in output


def test_a_worker_reports_a_missing_backend_and_a_full_disk_as_sentences(tmp_path):
    """A self-launched rank records these as user errors (sentences), not as tracebacks."""
    from lctrain.config import save_resolved, load_recipe
    from lctrain.launch.failures import read_records
    from lctrain.launch.rank import USER_ERROR_EXIT, worker_main
    from lctrain_kernels.backends import get_backend

    recipe = save_resolved(load_recipe(None), tmp_path / "recipe.yaml")

    def missing_backend(cfg, *, resume=False):
        get_backend("flash_attn_cute")  # the kernels' BackendUnavailable, as a rank meets it

    def full_disk(cfg, *, resume=False):
        with open("/dev/full", "w") as handle:  # the device that is always full
            handle.write("x")
            handle.flush()

    for worker, words in ((missing_backend, "FlashAttention 4"), (full_disk, "No space left on device")):
        errors = tmp_path / worker.__name__
        errors.mkdir()
        code = worker_main(worker, ["--config", str(recipe), "--error-dir", str(errors)])
        (record,) = read_records(errors)
        assert code == USER_ERROR_EXIT and record["user"] and words in record["message"]


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _background_save_fails_at_the_end(root: Path) -> None:
    """Written in the background (as on GPUs, through the writer): the failure is said when
    the run waits for the save."""
    import torch

    from lctrain.checkpoint.writer import Checkpointer
    from lctrain.errors import UserError

    module = torch.nn.Linear(512, 512)  # 1 MiB of weights: more than the disk holds
    saver = Checkpointer(root, module=module, optimizer=torch.optim.AdamW(module.parameters()),
                         keep=1, asynchronous=True)
    saver.save(1, {"step": 1})
    with pytest.raises(UserError, match=r"writing the checkpoint of step 1 .*No space left"):
        saver.close()
    assert not list(root.glob("step-*"))
    shutil.rmtree(root)


def test_a_full_disk_is_said(tmp_path):
    """A real full file system (a small tmpfs; needs the right to mount one): a full output
    folder is refused before the run, and a checkpoint that does not fit stops the run with
    the system's reason, leaving no checkpoint that --resume would pick."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "320k"):
        pytest.skip("mounting a tmpfs needs privileges this machine does not give")
    try:
        run = disk / "run"
        code, output = _invoke([*RUN, "--set", "checkpoint.keep=1", "--output-dir", str(run)],
                               tmp_path)
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert code == 1 and len(errors) == 1, output
        assert "writing the checkpoint of step 1" in errors[0]
        assert "(No space left on device" in errors[0]
        assert not list((run / "checkpoints").glob("step-*"))
        shutil.rmtree(run)
        _background_save_fails_at_the_end(disk / "background")
        fill(disk)  # what is left
        code, output = _invoke([*RUN, "--output-dir", str(disk / "other")], tmp_path)
        assert code == 1 and "cannot be written (No space left on device)" in output, output
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)  # also when a file is open
        os.sync()
