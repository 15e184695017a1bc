"""Where recipes, models and data live: shipped recipes, local paths and hub names.

Pure standard library, so that the CLI can check a recipe's paths before it starts any process
(and before importing torch); a hub name is checked by `lctrain.config.hub`.
"""
from __future__ import annotations

import glob
import importlib.resources
import os
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lctrain.config.hub import check_hub_model, looks_like_hub_name
from lctrain.errors import ConfigError

if TYPE_CHECKING:
    from lctrain.config.schema import RecipeConfig

DEFAULT_RECIPE = "tiny.yaml"
"""The embedded recipe `lctrain finetune` runs when no recipe is given."""

DATA_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local data file suffix -> how its records are read (`lctrain.data.records`)."""


def shipped_recipes() -> dict[str, str]:
    """Names of the shipped recipes (package ``lctrain_recipes``, folder recipes/lctrain_recipes)
    -> their YAML text."""
    root = importlib.resources.files("lctrain_recipes")
    return {entry.name: entry.read_text(encoding="utf-8")
            for entry in root.iterdir() if entry.name.endswith(".yaml")}


def read_recipe_text(path: str | os.PathLike | None) -> tuple[str, str]:
    """Return ``(yaml_text, source_name)`` for a recipe file, a shipped recipe name or None.

    ``None`` gives the embedded default (tiny.yaml). A path that does not exist but names a
    shipped recipe (``llama-7b-64k``, ``llama-7b-64k.yaml`` or ``recipes/llama-7b-64k.yaml`` from
    another folder) gives that shipped recipe.

    Raises:
        ConfigError: the file does not exist and no shipped recipe has that name.
    """
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
        raise ConfigError(f"recipe {str(path)!r} is a folder; give a YAML file such as "
                          f"{file / DEFAULT_RECIPE}")
    names = ", ".join(sorted(n.removesuffix(".yaml") for n in shipped))
    raise ConfigError(f"recipe file {str(path)!r} does not exist; give a YAML file or one of the "
                      f"shipped recipes ({names})")


def decode_text(data: bytes, source: str) -> str:
    """``data`` as UTF-8 text (a byte-order mark allowed), or a ConfigError naming the place of
    the first byte that is not."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(f"{source} is not UTF-8 text (byte {data[error.start]:#04x} at line "
                          f"{line}, column {column}); save it as UTF-8") from None


@dataclass(frozen=True)
class LocalData:
    """A data source that is local files."""

    builder: str
    """How the files are read: text, json or parquet."""
    files: list[str]
    """Matching files, sorted."""


def local_data(source: str, *, what: str = "data.source") -> LocalData | None:
    """Resolve ``data.source`` (or the setting named ``what``) to local files, or None for
    ``builtin`` and hub names. ``what`` is the dotted recipe key and the error's ``key``, so the
    loader says where the value came from (the recipe file or a ``--set``).

    Raises:
        ConfigError: the source looks local (a suffix, a glob, a path that exists) but matches
            no readable file, mixes suffixes, or has a suffix no builder reads.
    """
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
    if not files:
        raise ConfigError(f"{what} {source!r} matches no file; check the path (relative "
                          f"paths start from {os.getcwd()})", key=what)
    suffixes = {Path(f).suffix.lower() for f in files}
    unknown = suffixes - set(DATA_BUILDERS)
    if unknown:
        raise ConfigError(f"{what} {source!r} matches files ending in {sorted(unknown)}; "
                          f"lctrain reads .txt, .jsonl, .json and .parquet", key=what)
    builders = {DATA_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise ConfigError(f"{what} {source!r} mixes file kinds {sorted(suffixes)}; "
                          f"use a glob that matches one kind", key=what)
    return LocalData(builder=builders.pop(), files=files)


def is_placeholder(path: str | None) -> bool:
    """True for a ``model.path`` still holding a recipe's placeholder, such as
    ``<folder of Llama-3.1-8B>``: a value in angle brackets, which no real path or hub name is."""
    return isinstance(path, str) and path.startswith("<") and path.endswith(">")


def check_model_path(path: str | None) -> None:
    """Raise ConfigError when ``model.path`` is neither a model folder (with a readable
    config.json whose sizes can build a model) nor a hub name that the hub or its local cache
    can give (`check_hub_model`).

    A placeholder (see `is_placeholder`) passes here, so that a recipe for a real model can still
    be read, printed and sized with ``estimate-memory --model``; anything that needs the model
    itself calls `require_model_path`, which refuses it.
    """
    if path is None or is_placeholder(path):
        return
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        _check_model_folder(Path(expanded), path)
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
    """``model.path`` for code that loads the model or its tokenizer.

    Returns:
        The path with ``~`` expanded for a local folder, or the hub name as given.

    Raises:
        ConfigError: the path is unset or still the recipe's placeholder, or not a model folder.
    """
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
    """The parsed JSON of a model's ``config.json``, as `check_model_path` and ``estimate-memory
    --model`` read it: one reader, so that a damaged file gets one message wherever it is met.

    Args:
        file: the config.json.
        fix: what the message says after naming the fault (the folder is damaged, or fix the
            file when the user named the file itself).
        key: the recipe key the error is about (for the loader's attribution), or None.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 or is not valid JSON (with its line).
    """
    import json

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


def _check_model_folder(folder: Path, path: str) -> None:
    from lctrain.config.model_shapes import check_model_shapes

    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(f"model.path {path!r} has no config.json; point it at a model folder "
                          "(config.json, weights, tokenizer)", key="model.path")
    config = read_model_config(file)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{file} has no model_type; it is not a transformers model config",
                          key="model.path")
    check_model_shapes(config, str(file))


def absolute_paths(cfg: RecipeConfig) -> RecipeConfig:
    """The recipe with its local paths absolute (``~`` expanded): model.path and
    data.tokenizer when they are local folders, data.source when it is local files (a glob
    stays a glob), data.cache_dir and train.output_dir. Hub names and ``builtin`` / ``bytes``
    stay as they are."""
    def local(path: str | None) -> str | None:
        if path is None or not os.path.exists(os.path.expanduser(path)):
            return path
        return os.path.abspath(os.path.expanduser(path))

    def folder(path: str | None) -> str | None:
        return None if path is None else os.path.abspath(os.path.expanduser(path))

    source = cfg.data.source
    if local_data(source) is not None:
        source = os.path.abspath(os.path.expanduser(source))
    tokenizer = cfg.data.tokenizer if cfg.data.tokenizer == "bytes" else local(cfg.data.tokenizer)
    data = dataclasses.replace(cfg.data, source=source, tokenizer=tokenizer,
                               cache_dir=folder(cfg.data.cache_dir))
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=local(cfg.model.path)), data=data,
        train=dataclasses.replace(cfg.train, output_dir=folder(cfg.train.output_dir)))


def ordinary_permissions(path: str | os.PathLike) -> None:
    """Give a file the permissions a plain ``open()`` would have (0666 less the umask): files
    made by ``tempfile.mkstemp`` or safetensors are private (0600) otherwise."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
