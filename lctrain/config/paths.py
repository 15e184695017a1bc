"""Where recipes, models and data live: shipped recipes, local paths and hub names.

Pure standard library, so that the CLI can check a recipe's paths before it starts any process
(and before importing torch or datasets).
"""
from __future__ import annotations

import glob
import importlib.resources
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lctrain.errors import ConfigError

DEFAULT_RECIPE = "tiny.yaml"
"""The embedded recipe `lctrain finetune` runs when no recipe is given."""

DATA_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local data file suffix -> how its records are read (`lctrain.data.records`)."""

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")


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
        return file.read_text(encoding="utf-8"), str(path)
    name = file.name if file.name.endswith(".yaml") else f"{file.name}.yaml"
    if name in shipped and file.parent in (Path("."), Path("recipes")):
        return shipped[name], f"the shipped recipe {name}"
    if file.is_dir():
        raise ConfigError(f"recipe {str(path)!r} is a folder; give a YAML file such as "
                          f"{file / DEFAULT_RECIPE}")
    names = ", ".join(sorted(n.removesuffix(".yaml") for n in shipped))
    raise ConfigError(f"recipe file {str(path)!r} does not exist; give a YAML file or one of the "
                      f"shipped recipes ({names})")


def looks_like_hub_name(name: str) -> bool:
    """True for ``name`` or ``owner/name`` (the shapes of Hugging Face hub ids)."""
    return _HUB_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class LocalData:
    """A data source that is local files."""

    builder: str
    """How the files are read: text, json or parquet."""
    files: list[str]
    """Matching files, sorted."""


def local_data(source: str, *, what: str = "data.source") -> LocalData | None:
    """Resolve ``data.source`` (or the setting named ``what``) to local files, or None for
    ``builtin`` and hub names.

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
                          f"name; give a .txt/.jsonl/.json/.parquet file or glob")
    if os.path.isdir(expanded):
        raise ConfigError(f"{what} {source!r} is a folder; give a file or a glob such as "
                          f"{os.path.join(source, '*.jsonl')}")
    files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
    if not files:
        raise ConfigError(f"{what} {source!r} matches no file; check the path (relative "
                          f"paths start from {os.getcwd()})")
    suffixes = {Path(f).suffix.lower() for f in files}
    unknown = suffixes - set(DATA_BUILDERS)
    if unknown:
        raise ConfigError(f"{what} {source!r} matches files ending in {sorted(unknown)}; "
                          f"lctrain reads .txt, .jsonl, .json and .parquet")
    builders = {DATA_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise ConfigError(f"{what} {source!r} mixes file kinds {sorted(suffixes)}; "
                          f"use a glob that matches one kind")
    return LocalData(builder=builders.pop(), files=files)


def check_model_path(path: str | None) -> None:
    """Raise ConfigError when ``model.path`` is neither an existing folder nor a hub name."""
    if path is None:
        return
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return
    if os.path.exists(expanded):
        raise ConfigError(f"model.path {path!r} is a file; point it at the model folder (the one "
                          f"holding config.json)", key="model.path")
    if not looks_like_hub_name(path):
        raise ConfigError(f"model.path {path!r} does not exist; point it at a local model folder "
                          f"(with config.json) or a hub name such as meta-llama/Llama-2-7b-hf",
                          key="model.path")
