"""The README and the docs stay true.

- The README's quickstart is what CI runs, and the README and docs/performance.md stay short.
- Every lctrain command in a bash block of README.md and docs/*.md (also after ``python -m``,
  ``torchrun ... -m`` or ``accelerate launch ... -m``) runs through the real command line
  against recording stand-ins for the training, memory, export, evaluation and bench
  libraries, and the recorded call carries what the command says: the recipe with every
  ``--set`` applied, the lengths, GPUs, files and options given. The files a command needs
  (model folders under /models, data files, run folders) are made in a scratch folder first.
- Every published table is printed from its result file in benchmarks/results/, and every
  row of a table on the performance page (and the README's) comes from one.
- Every local link of the README and the docs points at a file that exists.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
import types
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lctrain.cli import app

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PERFORMANCE = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")
RESULTS = sorted((REPO / "benchmarks" / "results").glob("*/*.json"))


def _blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_quickstart_opens_the_readme_and_matches_ci():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    first_block = _blocks(README)[0]
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert commands == [
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . "
        "&& lctrain finetune", ci]
    assert README.index(first_block) < README.index("## ")
    assert "\n## Performance\n" in README


def test_the_readme_and_the_performance_page_stay_short():
    assert len(README.splitlines()) <= 200
    assert len(PERFORMANCE.splitlines()) <= 300


# ---------------------------------------------------------------------------------------------
# The commands of the pages


def _lctrain_args(line: str) -> list[str] | None:
    """The arguments after ``lctrain`` of one shell line, or None when it runs no lctrain."""
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if words[:1] == ["lctrain"]:
        return words[1:]
    for i in range(len(words) - 1):
        if words[i:i + 2] == ["-m", "lctrain"]:
            return words[i + 2:]
    return None


def _commands() -> list:
    out = []
    for page in PAGES:
        for block in _blocks(page.read_text(encoding="utf-8")):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                args = None if line.startswith("#") else _lctrain_args(line)
                if args:
                    name = f"{page.relative_to(REPO)}: lctrain {' '.join(args)}"
                    out.append(pytest.param(args, id=name[:110]))
    return out


COMMANDS = _commands()

FLAGS = {"--resume", "--peers", "--overlap-ablation", "--merge", "--plan", "--rows", "--wide",
         "--causal", "--full", "--balance-documents", "--packed-order", "--version", "--help"}


def _parse(args: list[str]) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """(command words, positional arguments, options) of an lctrain command line."""
    words = args[:2] if args[:1] in (["bench"], ["data"]) else args[:1]
    positional, options, i = [], {}, len(words)
    flags = FLAGS | ({"--json"} if words == ["estimate-memory"] else set())
    flags -= {"--rows"} if words == ["data", "preview"] else set()  # there --rows takes N
    while i < len(args):
        if args[i].startswith("--"):
            if args[i] in flags:
                options.setdefault(args[i], []).append("")
                i += 1
            else:
                options.setdefault(args[i], []).append(args[i + 1])
                i += 2
        else:
            positional.append(args[i])
            i += 1
    return words, positional, options


def test_the_pages_show_every_command():
    readme = [c.values[0] for c in COMMANDS if c.id.startswith("README.md")]
    for command in ("finetune", "data", "estimate-memory", "bench", "export", "eval", "report"):
        assert any(args[0] == command for args in readme), command
    for sub in ("kernel", "attention", "step", "report"):
        assert any(c.values[0][:2] == ["bench", sub] for c in COMMANDS), sub


# -- the files a command needs ----------------------------------------------------------------

def _family(name: str) -> str:
    lowered = name.lower()
    return next((family for key, family in (("llama-3", "llama3"), ("mistral", "mistral"),
                                            ("qwen", "qwen2")) if key in lowered), "llama2")


def _local_files(args: list[str], tmp_path: Path) -> list[str]:
    """Make what the command reads (model folders, data, run folders, result files) in
    tmp_path, the current folder; return the arguments with /models/... pointing there."""
    from lctrain.config import load_recipe, save_resolved

    out = []
    for arg in args:  # model folders: /models/NAME becomes tmp_path/models/NAME
        match = re.search(r"(/models/[^\s,]+)", arg)
        if match:
            folder = tmp_path / match.group(1).lstrip("/")
            if not folder.exists():
                from model_folders import make_model_folder

                make_model_folder(folder.parent, _family(folder.name), name=folder.name)
            arg = arg.replace(match.group(1), str(folder))
        out.append(arg)
    words, positional, options = _parse(out)
    sets = dict(item.split("=", 1) for item in options.get("--set", []))
    for key in ("data.source", "data.eval_source"):
        source = sets.get(key, "").strip("'\"")
        if source and source != "builtin" and not source.startswith("/"):
            path = tmp_path / source.replace("*", "part")
            path.parent.mkdir(parents=True, exist_ok=True)
            fmt = sets.get("data.format", "text")
            record = ({"messages": [{"role": "user", "content": "Hi?"},
                                    {"role": "assistant", "content": "Hello."}]}
                      if fmt == "chat" else {"prompt": "Q: ", "completion": "A."}
                      if fmt == "prompt_completion" else {"text": "some words " * 20})
            path.write_text(json.dumps(record) + "\n")
    tokenizer = sets.get("data.tokenizer", "")
    if "/" in tokenizer and not tokenizer.startswith("/"):  # a tokenizer folder the page names
        from model_folders import build_tokenizer

        build_tokenizer("llama3").save_pretrained(tmp_path / tokenizer)
    if words == ["report"]:  # the runs it reads, as lctrain finetune leaves them
        for run in positional:
            save_resolved(load_recipe(None, output_dir=run), tmp_path / run / "config.yaml")
            (tmp_path / run / "metrics.jsonl").write_text(
                "".join(json.dumps({"step": s, "loss": 5.0 / s, "tokens_per_s": 100.0,
                                    "step_time_s": 1.0}) + "\n" for s in (1, 2)))
    if "--resume" in options:  # the run it continues
        run = options["--output-dir"][0]
        save_resolved(load_recipe(None, output_dir=run), tmp_path / run / "config.yaml")
    if words == ["bench", "report"]:  # published files are read where they are
        for i, arg in enumerate(out):
            if arg.endswith(".json"):
                if (REPO / arg).exists():
                    out[i] = str(REPO / arg)
                else:
                    _bench_result("attention").save(tmp_path / arg)
    return out


# -- the stand-ins ----------------------------------------------------------------------------

def _bench_result(kind: str):
    from lctrain.bench.result import BenchResult

    row = {"seq_len": 1024, "status": "ok", "total_tflops": 1.0, "backend": "x", "variant": "x",
           "step_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1}
    return BenchResult(kind=kind, title=kind, rows=[row])


def _eval_result(task: str):
    from lctrain.eval.result import EvalResult

    rows = ([{"bucket": "0–4K", "start": 0, "stop": 4096, "tokens": 9, "loss": 2.0, "ppl": 7.4},
             {"bucket": "all", "start": 0, "stop": 4096, "tokens": 9, "loss": 2.0, "ppl": 7.4}]
            if task == "ppl" else
            [{"seq_len": 1024, "depth": 0.5, "needle_position": 500, "accuracy": 1.0,
              "correct": 1, "trials": 1, "passkey": "12345", "answer": "12345."}])
    return EvalResult(task=task, title=task, rows=rows, meta={"seq_len": 4096})


def _stand_ins(monkeypatch) -> list[tuple[str, tuple, dict]]:
    """Record the library calls as (name, args, kwargs); a bench returns a real (tiny)
    BenchResult and eval a real EvalResult, so the output path (table, JSON, plot) runs."""
    import lctrain.bench.data
    import lctrain.bench.dist_attention
    import lctrain.bench.kernel
    import lctrain.bench.step
    import lctrain.eval.request

    calls: list[tuple[str, tuple, dict]] = []

    def recorder(name, result):
        def call(*args, **kwargs):
            calls.append((name, args, kwargs))
            return result(*args, **kwargs) if callable(result) else result
        return call

    memory = types.SimpleNamespace(to_json=lambda: {"per_gpu_bytes": {"total": 1}, "fits": True})
    plan = {"model": "m", "machine": {"gpus": 1, "gpu_memory": 1, "host_memory": None,
                                      "gpus_per_node": 1}, "seq_len": None, "longest": None,
            "fastest": None}
    exported = types.SimpleNamespace(kind="full", step=1, dtype="float32", output="out",
                                     files=("config.json",), base=None, tokenizer_note="")
    for module, attrs in [("lctrain.train.runner", {"finetune": 0}),
                          ("lctrain.memory", {"estimate_recipe": memory, "plan_recipe": plan}),
                          ("lctrain.export", {"export_run": exported})]:
        fake = types.ModuleType(module)
        for attr, result in attrs.items():
            setattr(fake, attr, recorder(f"{module}.{attr}", result))
        monkeypatch.setitem(sys.modules, module, fake)
    monkeypatch.setattr(lctrain.eval.request, "resolve", recorder(  # the target need not exist
        "lctrain.eval.request.resolve",
        lambda target, *, task, **_: (None, types.SimpleNamespace(task=task))))
    fake = types.ModuleType("lctrain.eval.evaluate")
    fake.evaluate = recorder("lctrain.eval.evaluate.evaluate",
                             lambda cfg, request, **_: _eval_result(request.task))
    monkeypatch.setitem(sys.modules, "lctrain.eval.evaluate", fake)
    for module, kind in [(lctrain.bench.kernel, "kernel"), (lctrain.bench.dist_attention, "attention"),
                         (lctrain.bench.step, "step"), (lctrain.bench.data, "data")]:
        monkeypatch.setattr(module, "run", recorder(f"{module.__name__}.run", _bench_result(kind)))
    return calls


# -- what the recorded call must carry --------------------------------------------------------

def _setting(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part)
    return value


def _same(actual, text: str, tmp_path: Path) -> bool:
    """Whether a recipe value is what ``--set key=text`` asked for (sizes parsed, paths made
    absolute, one name standing for a list of one, a list spelled with commas)."""
    from lctrain.config import parse_memory, parse_size

    wanted = yaml.safe_load(text)
    if isinstance(actual, tuple):
        actual = list(actual)
    if actual == wanted or (wanted is None and actual in ({}, [], ())):
        return True
    if dataclasses.is_dataclass(actual) or not isinstance(wanted, str):
        return str(actual) == str(wanted)
    for parse in (parse_size, parse_memory, float):  # 64k, 240GiB, 5e6
        try:
            if parse(wanted) == actual:
                return True
        except Exception:  # noqa: BLE001 - not that kind of value
            pass
    if isinstance(actual, list) and ",".join(map(str, actual)) == wanted:
        return True
    text_value = str(actual)
    return (text_value.replace(" ", "") == wanted.replace(" ", "")
            or Path(text_value) == (tmp_path / wanted).resolve()
            or text_value == str(tmp_path / wanted))


def _check_recipe(cfg, items: list[str], tmp_path: Path) -> None:
    for item in items:
        key, text = item.split("=", 1)
        assert _same(_setting(cfg, key), text, tmp_path), (key, _setting(cfg, key), text)


def _check_call(args: list[str], calls: list, tmp_path: Path, output: str) -> None:
    from lctrain.config import parse_memory, parse_size, parse_size_list

    words, positional, options = _parse(args)
    one = {key: values[-1] for key, values in options.items()}
    sets = options.get("--set", [])
    if "--json" in one and one["--json"]:
        assert (tmp_path / one["--json"]).is_file(), one["--json"]
    if "--plot" in one:
        assert (tmp_path / one["--plot"]).is_file(), one["--plot"]
    if words == ["bench", "report"]:
        assert not calls and output.strip()
        return
    if words == ["report"]:
        assert not calls and all(Path(run).name in output for run in positional)
        return
    if words == ["data", "preview"]:  # runs for real on the scratch data: it is CPU work
        source = next(s.split("=", 1)[1] for s in sets if s.startswith("data.source="))
        assert not calls and Path(source).name in output and "trained" in output, output
        return
    if words == ["eval"]:
        (name, _, resolve), (evaluated, _, _) = calls
        assert (name, evaluated) == ("lctrain.eval.request.resolve", "lctrain.eval.evaluate.evaluate")
        assert resolve["task"] == one.get("--task", "ppl") and resolve["overrides"] == sets
        for option, key, parse in [("--step", "step", int), ("--seq-len", "seq_len", parse_size),
                                   ("--cp", "cp", int), ("--data", "data", str),
                                   ("--bucket", "bucket", parse_size), ("--trials", "trials", int),
                                   ("--max-rows", "max_rows", int),
                                   ("--lengths", "lengths", parse_size_list)]:
            assert resolve[key] == (parse(one[option]) if option in one else None), option
        if "--depths" in one:
            assert resolve["depths"] == [float(d) for d in one["--depths"].split(",")]
        return
    assert len(calls) == 1, calls
    name, call_args, kwargs = calls[0]
    if words == ["finetune"]:
        assert name == "lctrain.train.runner.finetune"
        cfg = call_args[0]
        _check_recipe(cfg, sets, tmp_path)
        assert kwargs["resume"] == ("--resume" in one)
        assert kwargs["nproc"] == (int(one["--nproc"]) if "--nproc" in one else None)
        if "--seq-len" in one:
            assert cfg.data.seq_len == parse_size(one["--seq-len"])
        if "--max-steps" in one:
            assert cfg.train.max_steps == int(one["--max-steps"])
        if "--output-dir" in one:
            wanted = (tmp_path / one["--output-dir"]).resolve()
            assert Path(cfg.train.output_dir).resolve() == wanted
        if "--resume" not in one:  # the recipe named, or the embedded one, and nothing else
            from lctrain.config import load_recipe

            assert cfg == load_recipe(
                positional[0] if positional else None, sets,
                seq_len=parse_size(one["--seq-len"]) if "--seq-len" in one else None,
                output_dir=one.get("--output-dir"),
                max_steps=int(one["--max-steps"]) if "--max-steps" in one else None)
    elif words == ["estimate-memory"]:
        assert name == ("lctrain.memory.plan_recipe" if "--plan" in one
                        else "lctrain.memory.estimate_recipe")
        cfg = call_args[0]
        if positional or sets:
            _check_recipe(cfg, sets, tmp_path)
        assert kwargs["model"] == (one.get("--model"))
        for option, key, parse in [("--gpus", "gpus", int), ("--seq-len", "seq_len", parse_size),
                                   ("--gpu-memory", "gpu_memory", parse_memory),
                                   ("--host-memory", "host_memory", parse_memory),
                                   ("--gpus-per-node", "gpus_per_node", int)]:
            if option in one:
                assert kwargs[key] == parse(one[option]), option
        if "--cp" in one:
            assert kwargs["cp"] == int(one["--cp"])
    elif words == ["export"]:
        assert name == "lctrain.export.export_run" and call_args == (positional[0],)
        assert kwargs == {"output": one["--output"],
                          "step": int(one["--step"]) if "--step" in one else None,
                          "dtype": one.get("--dtype"), "merge": "--merge" in one}
    elif words == ["bench", "kernel"] or words == ["bench", "attention"]:
        assert name == f"lctrain.bench.{ {'attention': 'dist_attention'}.get(words[1], words[1])}.run"
        if "--seq-len" in one:
            assert kwargs["seq_lens"] == parse_size_list(one["--seq-len"])
        if "--documents" in options:
            documents = kwargs["documents"]
            assert (documents if isinstance(documents, list) else [documents]) \
                == options["--documents"]
        if "--check-len" in one:
            assert kwargs["check_len"] == parse_size(one["--check-len"])
        if words[1] == "kernel" and "--backend" in one:
            assert kwargs["backends"] == one["--backend"].split(",")
        if words[1] == "attention":
            assert kwargs["peers"] == ("--peers" in one)
            assert kwargs["nproc"] == (int(one["--nproc"]) if "--nproc" in one else None)
    elif words == ["bench", "data"]:
        assert name == "lctrain.bench.data.run"
        _check_recipe(call_args[0], sets, tmp_path)
    elif words == ["bench", "step"]:
        assert name == "lctrain.bench.step.run"
        configs, variants = call_args[0], options.get("--variant", [""])
        lengths = parse_size_list(one["--seq-len"]) if "--seq-len" in one else [None]
        assert [label for label, _ in configs] == variants * len(lengths)
        for i, (label, cfg) in enumerate(configs):
            _check_recipe(cfg, [*sets, *shlex.split(label)], tmp_path)
            if lengths[i // len(variants)] is not None:
                assert cfg.data.seq_len == lengths[i // len(variants)]
        assert kwargs["steps"] == int(one.get("--steps", 10))
        assert kwargs["warmup"] == int(one.get("--warmup", 1))
        assert kwargs["nproc"] == (int(one["--nproc"]) if "--nproc" in one else None)
    else:
        raise AssertionError(f"no check for lctrain {' '.join(words)}")


@pytest.mark.parametrize("args", COMMANDS)
def test_a_documented_command_makes_the_call_it_says(args, monkeypatch, tmp_path):
    calls = _stand_ins(monkeypatch)
    monkeypatch.chdir(tmp_path)  # outputs land here; shipped recipe names resolve as anywhere
    args = _local_files(args, tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    _check_call(args, calls, tmp_path, result.output)


# ---------------------------------------------------------------------------------------------
# Published tables and their result files


def _table_rows(path: Path) -> list[str]:
    result = CliRunner().invoke(app, ["bench", "report", str(path), "--format", "markdown"])
    assert result.exit_code == 0, result.output
    return [line for line in result.stdout.splitlines() if line.startswith("| ")][1:]


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_published_tables_are_printed_from_their_result_files(path):
    """Every result file's table, as `lctrain bench report FILE --format markdown` prints it,
    is published on the performance page with the command that wrote the file (the README
    repeats one; each row verbatim)."""
    body = _table_rows(path)
    name = str(path.relative_to(REPO))
    assert body and f"--json {name}" in PERFORMANCE.replace("\\\n    ", ""), name
    for line in body:
        assert line in PERFORMANCE, line
    if any(line in README for line in body):
        assert all(line in README for line in body), name


def test_every_published_number_comes_from_a_result_file():
    """The rows of every table on the performance page and under the README's Performance
    heading are rows some result file prints (headers and separators aside)."""
    printed = {line for path in RESULTS for line in _table_rows(path)}
    readme = README.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    for text in (PERFORMANCE, readme):
        for line in text.splitlines():
            if line.startswith("| ") and not line.startswith(("| length ", "| positions ",
                                                              "| source ")):
                assert line in printed, line


def test_local_links_point_at_files():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+://", target):
                assert (page.parent / target).exists(), (page.name, target)
