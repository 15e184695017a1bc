"""Where recipes, models and data live: shipped recipes, local paths and hub names (standard
library only, so the CLI checks paths before importing torch)."""
from __future__ import annotations

import glob
import importlib.resources
import os
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

from lctrain.config.hub import check_hub_model, hub_split, looks_like_hub_name
from lctrain.errors import ConfigError

if TYPE_CHECKING:
    from lctrain.config.schema import RecipeConfig

DEFAULT_RECIPE = "tiny.yaml"
"""The embedded recipe `lctrain finetune` runs when no recipe is given."""

DATA_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local data file suffix -> how its records are read (`lctrain.data.records`)."""


def shipped_recipes() -> dict[str, str]:
    """The shipped recipes (package ``lctrain_recipes``): name -> YAML text."""
    root = importlib.resources.files("lctrain_recipes")
    return {entry.name: entry.read_text(encoding="utf-8")
            for entry in root.iterdir() if entry.name.endswith(".yaml")}


def read_recipe_text(path: str | os.PathLike | None) -> tuple[str, str]:
    """``(yaml_text, source)`` of a file, a shipped recipe's name or None (ConfigError: none)."""
    shipped = shipped_recipes()
    if path is None:
        return shipped[DEFAULT_RECIPE], f"the embedded recipe {DEFAULT_RECIPE}"
    file = Path(path).expanduser()
    if file.is_file():
        try:
            return decode_text(file.read_bytes(), str(path)), str(path)
        except OSError as error:
            raise ConfigError(f"recipe file {str(path)!r} cannot be read "
                              f"({error.strerror or type(error).__name__})") from None
    name = file.name if file.name.endswith(".yaml") else f"{file.name}.yaml"
    if name in shipped and file.parent in (Path("."), Path("recipes")):
        return shipped[name], f"the shipped recipe {name}"
    if file.is_dir():
        saved = file / "config.yaml"  # a run's folder: the recipe it saved
        raise ConfigError(f"recipe {str(path)!r} is a folder; give a YAML file such as "
                          f"{saved if saved.is_file() else file / DEFAULT_RECIPE}")
    names = ", ".join(sorted(n.removesuffix(".yaml") for n in shipped))
    raise ConfigError(f"recipe file {str(path)!r} does not exist; give a YAML file or one of the "
                      f"shipped recipes ({names})")


def bad_byte(data: bytes, error: UnicodeDecodeError) -> tuple[int, int]:
    """The 1-based line and column in ``data`` of the byte that ``error`` could not decode."""
    line = data.count(b"\n", 0, error.start) + 1
    return line, error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1


def decode_text(data: bytes, source: str) -> str:
    """``data`` as UTF-8 text (BOM allowed), or a ConfigError naming the first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line, column = bad_byte(data, error)
        raise ConfigError(f"{source} is not UTF-8 text (byte {data[error.start]:#04x} at line "
                          f"{line}, column {column}); save it as UTF-8") from None


@dataclasses.dataclass(frozen=True)
class LocalData:
    """A data source that is local files."""

    builder: str
    """How the files are read: text, json or parquet."""
    files: list[str]
    """Matching files, sorted."""


def local_data(source: str, *, what: str = "data.source") -> LocalData | None:
    """``data.source`` (or ``what``) as local files; None for builtin and hub names (ConfigError);
    a hub name may end in ``[split]`` where no local file matches it as a glob."""
    if source == "builtin":
        return None
    expanded = os.path.expanduser(source)
    is_pattern = glob.has_magic(expanded)
    suffix = Path(expanded).suffix.lower()
    if not (is_pattern or suffix in DATA_BUILDERS or os.path.exists(expanded)):
        if looks_like_hub_name(source):
            return None
        raise ConfigError(f"{what} {source!r} is neither builtin, an existing file nor a hub "
                          f"name; give a .txt/.jsonl/.json/.parquet file or glob", key=what)
    if os.path.isdir(expanded):
        raise ConfigError(f"{what} {source!r} is a folder; give a file or a glob such as "
                          f"{os.path.join(source, '*.jsonl')}", key=what)
    files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
    if not files and hub_split(source)[0] != source:  # no local match: a hub dataset's split
        return None
    if not files:
        raise ConfigError(f"{what} {source!r} matches no file; check the path (relative "
                          f"paths start from {os.getcwd()})", key=what)
    suffixes = {Path(f).suffix.lower() for f in files}
    if unknown := suffixes - set(DATA_BUILDERS):
        raise ConfigError(f"{what} {source!r} matches files ending in {sorted(unknown)}; "
                          f"lctrain reads .txt, .jsonl, .json and .parquet", key=what)
    builders = {DATA_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise ConfigError(f"{what} {source!r} mixes file kinds {sorted(suffixes)}; "
                          f"use a glob that matches one kind", key=what)
    return LocalData(builder=builders.pop(), files=files)


def is_placeholder(path: str | None) -> bool:
    """True for a ``model.path`` still a recipe's placeholder (a value in angle brackets)."""
    return isinstance(path, str) and path.startswith("<") and path.endswith(">")


def check_model_path(path: str | None) -> None:
    """ConfigError unless ``model.path`` is a model folder, a readable hub name or a placeholder."""
    if path is None or is_placeholder(path):
        return
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        from lctrain.config.schema import check_model_shapes

        file = Path(expanded) / "config.json"
        if not file.is_file():
            raise ConfigError(f"model.path {path!r} has no config.json; point it at a model "
                              "folder (config.json, weights, tokenizer)", key="model.path")
        config = read_model_config(file)
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise ConfigError(f"{file} has no model_type; it is not a transformers model config",
                              key="model.path")
        check_model_shapes(config, str(file))
        return
    if os.path.exists(expanded):
        raise ConfigError(f"model.path {path!r} is a file; point it at the model folder (the one "
                          f"holding config.json)", key="model.path")
    if not looks_like_hub_name(path):
        raise ConfigError(f"model.path {path!r} does not exist; point it at a local model folder "
                          f"(with config.json) or a hub name such as meta-llama/Llama-3.1-8B",
                          key="model.path")
    check_hub_model(path)


def require_model_path(path: str | None) -> str:
    """``model.path`` to load (``~`` expanded); ConfigError: unset, placeholder, not a model."""
    if path is None or is_placeholder(path):
        shown = f"is still the placeholder {path!r}" if path else "is not set"
        raise ConfigError(f"model.path {shown}: this recipe fine-tunes a pretrained model, so set "
                          f"it to the model's folder (config.json, *.safetensors and tokenizer "
                          f"files), e.g. --set model.path=/models/Llama-3.1-8B", key="model.path")
    check_model_path(path)
    expanded = os.path.expanduser(path)
    return expanded if os.path.isdir(expanded) else path


def read_model_config(file: str | os.PathLike, *, fix: str = "the model folder is damaged",
                      key: str | None = "model.path") -> object:
    """A model's parsed ``config.json`` (ConfigError naming ``key``; ``fix`` says what to do)."""
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{file} is not UTF-8 text; {fix}", key=key) from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file}:{error.lineno} is not valid JSON ({error.msg} at column "
                          f"{error.colno}); {fix}", key=key) from None
    except OSError as error:
        raise ConfigError(f"{file} cannot be read ({error.strerror or type(error).__name__})",
                          key=key) from None


def absolute_paths(cfg: RecipeConfig) -> RecipeConfig:
    """The recipe with its local paths absolute (``~`` expanded); hub names and built-ins stay."""
    def absolute(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path))

    def local(path: str | None) -> str | None:
        return absolute(path) if path and os.path.exists(os.path.expanduser(path)) else path

    source = cfg.data.source if local_data(cfg.data.source) is None else absolute(cfg.data.source)
    held_out = cfg.data.eval_source  # a share, or a source like data.source
    if isinstance(held_out, str) and local_data(held_out, what="data.eval_source") is not None:
        held_out = absolute(held_out)
    tokenizer = cfg.data.tokenizer if cfg.data.tokenizer in ("bytes", "byte-pairs") \
        else local(cfg.data.tokenizer)
    template = cfg.data.chat_template  # a name, or a .jinja file the run reads from anywhere
    if template is not None and os.path.isfile(os.path.expanduser(template)):
        template = absolute(template)
    data = dataclasses.replace(cfg.data, source=source, eval_source=held_out, tokenizer=tokenizer,
                               chat_template=template)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=local(cfg.model.path)), data=data,
        train=dataclasses.replace(cfg.train, output_dir=absolute(cfg.train.output_dir)))


def ordinary_permissions(path: str | os.PathLike) -> None:
    """Give a file a plain ``open()``'s permissions (0666 less the umask; mkstemp's are 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
