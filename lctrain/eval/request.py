"""What ``lctrain eval`` is asked: the target, the task, and the recipe it runs under.

A target is a run folder (its newest checkpoint, or ``--step N``), one of its checkpoints, a model
folder (config.json), or a recipe. `resolve` turns the command's options into that recipe and an
`EvalRequest` for every rank. Nothing here imports torch."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

from lctrain.config import (ParallelConfig, RecipeConfig, build_recipe, load_recipe, local_data,
                            read_resolved)
from lctrain.config.loader import parse_override, set_key
from lctrain.config.paths import check_model_path, shipped_recipes
from lctrain.errors import UserError
from lctrain_kernels.vocabulary import check_seq_len

CHECKPOINT_NAME = re.compile(r"step-\d{8}")  # as `lctrain.checkpoint.reader` names them
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_BUCKETS = 16  # position buckets of a perplexity run without --bucket


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """What every rank of an evaluation needs besides the recipe (JSON-serialisable); ``part``
    "eval" is the validation data, ``kind`` one of run, model, adapter, recipe."""

    task: str
    target: str
    kind: str
    checkpoint: str | None = None
    step: int | None = None
    part: str = "train"
    max_rows: int | None = None
    bucket: int = 1
    lengths: tuple[int, ...] = ()
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 1
    seed: int = 0
    result_file: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EvalRequest:
        fields = json.loads(text)
        return cls(**{**fields, "lengths": tuple(fields["lengths"]),
                      "depths": tuple(fields["depths"])})


def resolve(target: str, *, task: str, step: int | None = None, seq_len: int | None = None,
            cp: int | None = None, data: str | None = None, overrides: list[str] = (),
            bucket: int | None = None, max_rows: int | None = None,
            lengths: list[int] | None = None, depths: list[float] | None = None,
            trials: int | None = None, seed: int | None = None
            ) -> tuple[RecipeConfig, EvalRequest]:
    """The recipe and request of ``lctrain eval TARGET``; None means not given (UserError:
    a target, step, override, length, depth or data source that cannot be evaluated)."""
    if task not in ("ppl", "passkey"):
        raise UserError(f"--task {task!r} is not one of ppl, passkey")
    owner = "passkey" if task == "ppl" else "ppl"  # refuse the other task's options
    other = {"--lengths": lengths, "--depths": depths, "--trials": trials, "--seed": seed} \
        if task == "ppl" else {"--bucket": bucket, "--max-rows": max_rows, "--data": data}
    given = [name for name, value in other.items() if value is not None]
    if given:
        raise UserError(f"{given[0]} is a setting of --task {owner}, not of --task {task}; drop "
                        f"it or use --task {owner}")
    if task == "passkey" and seq_len is not None and lengths:
        raise UserError("--seq-len and --lengths both give the passkey length; give --lengths "
                        "alone (several lengths) or --seq-len alone (one)")
    raw, kind, source = _target_recipe(target)
    checkpoint = None
    if step is not None and kind != "run":
        raise UserError(f"--step {step} needs a run folder, but {target} is a {kind}; drop --step")
    if kind in ("run", "checkpoint"):
        from lctrain.checkpoint.reader import find_checkpoint

        path = Path(target).expanduser()
        if kind == "checkpoint":  # RUN/checkpoints/step-N: the run at that step
            path, step = path.parent.parent, int(path.name.split("-")[1])
        step, path = find_checkpoint(path / "checkpoints", step)
        checkpoint, kind = str(path), "run"
    explicit = set()
    for item in overrides:
        key, value = parse_override(item)
        set_key(raw, key, value, where=f"--set {item}")
        explicit.add(key)
    has_eval = bool(raw.get("data", {}).get("eval_source"))
    lengths = list(lengths or [])
    _settle(raw, task=task, seq_len=seq_len, cp=cp, data=data, lengths=lengths,
            format_given="data.format" in explicit)
    parallel = ParallelConfig(**raw["parallel"])
    for length in lengths:  # before the recipe, which would name the longest data.seq_len
        try:
            check_seq_len(length, parallel.cp, parallel.layout, what="passkey length", ranks="--cp")
        except ValueError as error:
            raise UserError(str(error)) from None
    cfg = build_recipe(raw, source)
    check_model_path(cfg.model.path)
    if task == "ppl":  # passkey prompts are generated: the data may be gone
        local_data(cfg.data.source)
    if task == "passkey" and not lengths:
        lengths = [cfg.data.seq_len]
    depths = tuple(DEFAULT_DEPTHS if depths is None else depths)
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise UserError(f"--depths holds {depth:g}, outside [0, 1]; give depths such as "
                            "0,0.25,0.5,0.75,1")
    if bucket is not None and bucket < 1:
        raise UserError(f"--bucket {bucket} must be at least 1 token")
    if trials is not None and trials < 1:
        raise UserError(f"--trials {trials} must be at least 1")
    return cfg, EvalRequest(
        task=task, target=str(target), kind=kind, checkpoint=checkpoint, step=step,
        part="eval" if has_eval and data is None else "train", max_rows=max_rows,
        bucket=bucket or math.ceil(cfg.data.seq_len / DEFAULT_BUCKETS), lengths=tuple(lengths),
        depths=depths, trials=trials or 1, seed=seed or 0)


def _target_recipe(target: str) -> tuple[dict, str, str]:
    """(the target's recipe as plain data, its kind, its name in errors)."""
    path = Path(target).expanduser()
    if path.is_dir() and (path / "config.yaml").is_file():
        return read_resolved(path / "config.yaml").to_dict(), "run", str(path / "config.yaml")
    run = path.parent.parent
    if path.is_dir() and CHECKPOINT_NAME.fullmatch(path.name) and path.parent.name == \
            "checkpoints" and (run / "config.yaml").is_file():
        return read_resolved(run / "config.yaml").to_dict(), "checkpoint", str(run / "config.yaml")
    adapter = (path / "adapter_config.json").is_file() and not (path / "model.safetensors").exists()
    if path.is_dir() and ((path / "config.json").is_file() or adapter):
        import torch  # here only: resolving a run or a recipe needs none

        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        model, tokenizer = str(path), None
        if adapter:  # a peft adapter: its base model, merged with it before the ranks start
            model = _adapter_base(path)
            tokenizer = str(path) if any(path.glob("tokenizer*")) else model  # else the base's
        return ({"model": {"path": model}, "data": {"tokenizer": tokenizer},
                 "parallel": {"cp": max(cuda, 1)}, "train": {"mixed_precision": "auto"}},
                "adapter" if adapter else "model", str(path))
    if path.is_dir():
        raise UserError(f"{target} is a folder with neither config.yaml (a run folder) nor "
                        "config.json (a model folder), nor a checkpoint of a run; pass one of "
                        "those, or a recipe")
    shipped = path.name if path.name.endswith(".yaml") else f"{path.name}.yaml"  # tiny, ...
    if not path.exists() and not (shipped in shipped_recipes()
                                  and path.parent in (Path("."), Path("recipes"))):
        names = ", ".join(sorted(n.removesuffix(".yaml") for n in shipped_recipes()))
        raise UserError(f"TARGET {target} does not exist; give a run folder, one of its "
                        "checkpoints (RUN/checkpoints/step-N), a model folder (config.json), a "
                        f"recipe file or a shipped recipe ({names})")
    return load_recipe(target).to_dict(), "recipe", str(target)


def _adapter_base(folder: Path) -> str:
    """The base model a peft adapter folder names (a folder, relative to the adapter's, or a hub
    name). UserError: it names none, or a folder that is gone."""
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get(
            "base_model_name_or_path")
    except (OSError, ValueError) as error:
        raise UserError(f"{folder / 'adapter_config.json'} cannot be read ({error}); export "
                        "the LoRA run again") from None
    if not base:
        raise UserError(f"{folder} holds a LoRA adapter that names no base model "
                        "(base_model_name_or_path); evaluate the run folder, or export it with "
                        "--merge and evaluate that")
    local = (folder / base).resolve()
    if local.is_dir():
        return str(local)
    if Path(base).is_absolute() or base.startswith("."):
        raise UserError(f"{folder} holds a LoRA adapter whose base model {base} is gone; "
                        "evaluate the run folder, or export it with --merge and evaluate that")
    return base


def _settle(raw: dict, *, task: str, seq_len: int | None, cp: int | None, data: str | None,
            lengths: list[int], format_given: bool) -> None:
    """The settings every evaluation runs under, on top of the target's and --set's
    (``--data`` detects its own format unless ``--set data.format`` gives it)."""
    sections = {name: raw.setdefault(name, {}) for name in ("data", "parallel", "train",
                                                           "checkpoint")}
    if seq_len is not None:
        sections["data"]["seq_len"] = seq_len
    if task == "passkey" and lengths:
        sections["data"]["seq_len"] = max(lengths)
    if cp is not None:
        sections["parallel"]["cp"] = cp
    if data is not None:
        sections["data"].update(source=data, eval_source=None)
        if not format_given:
            sections["data"]["format"] = "auto"
    state = [item for item in str(sections["train"].get("offload", "none")).split(",")
             if item.strip() in ("optimizer", "state")]  # no layers to park: no checkpointing
    sections["train"].update(checkpointing="none", offload=",".join(state) or "none",
                             eval_every=0, report_to=["jsonl"])
    sections["checkpoint"].update(keep=0)
