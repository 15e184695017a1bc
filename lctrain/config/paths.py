"""Where recipes, models and data live: shipped recipes, local paths and hub names.

Pure standard library (and, for a hub name, huggingface_hub's or datasets' cache lookup), so
that the CLI can check a recipe's paths before it starts any process (and before importing torch).

A model, tokenizer or dataset given by hub name must come from the hub or a local cache. When
neither can give it — offline mode (HF_HUB_OFFLINE) or a hub that does not answer within
`HUB_PROBE_TIMEOUT_S`, and no copy in the cache — `check_hub_model`, `check_hub_tokenizer` and
`check_hub_dataset` say so at once, where transformers and datasets would retry for about 20 s
and then fail in several lines. When the hub does not answer but the cache holds the name,
`cache_only` tells the loaders to read the cache at once instead of retrying first. The hub is
probed once per process (`hub_answers`).
"""
from __future__ import annotations

import functools
import glob
import importlib.resources
import os
import re
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lctrain.errors import ConfigError

if TYPE_CHECKING:
    from lctrain.config.schema import RecipeConfig

DEFAULT_RECIPE = "tiny.yaml"
"""The embedded recipe `lctrain finetune` runs when no recipe is given."""

DATA_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local data file suffix -> how its records are read (`lctrain.data.records`)."""

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")

HUB_PROBE_TIMEOUT_S = 3.0
"""How long `hub_answers` waits for the hub to answer before calling it unreachable."""
_DEFAULT_HUB = "https://huggingface.co"
_TRANSFORMERS_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""The variables that set offline mode for transformers (models, configs, tokenizers)."""
_DATASETS_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
"""The variables that set offline mode for ``datasets.load_dataset``."""
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")
"""Files of a tokenizer repository of which ``AutoTokenizer`` reads one first."""


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


def check_hub_model(name: str, *, what: str = "model.path") -> None:
    """Refuse at once a hub name that neither the hub nor its local cache can give.

    A name whose config.json is in the local hub cache passes (transformers reads it from
    there); otherwise the hub must be reachable: offline mode (``HF_HUB_OFFLINE`` or
    ``TRANSFORMERS_OFFLINE``) is refused without a probe, else the hub (``HF_ENDPOINT``, default
    huggingface.co) must answer one request within `HUB_PROBE_TIMEOUT_S` (`hub_answers`).

    Args:
        name: the hub name (``owner/name``).
        what: the setting or option it came from (the message and the error's key).

    Raises:
        ConfigError: offline mode or an unreachable hub, and the name is not in the cache.
    """
    from huggingface_hub import constants

    cached = _in_hub_cache(name, ("config.json",))
    if cached is not False:
        return
    _refuse_uncached(f"the config of model {name!r}", what, flags=_TRANSFORMERS_OFFLINE,
                     where=f"the local hub cache ({constants.HF_HUB_CACHE}) does not hold it",
                     fix=f"point {what} at a local model folder")


def check_hub_tokenizer(name: str, *, what: str = "data.tokenizer") -> None:
    """`check_hub_model` for a tokenizer given by hub name: it passes when the local hub cache
    holds its tokenizer_config.json, tokenizer.json or config.json (what ``AutoTokenizer``
    reads first), or when the hub answers.

    Raises:
        ConfigError: offline mode or an unreachable hub, and the name is not in the cache.
    """
    from huggingface_hub import constants

    if _in_hub_cache(name, _TOKENIZER_FILES) is not False:
        return
    _refuse_uncached(f"the tokenizer {name!r}", what, flags=_TRANSFORMERS_OFFLINE,
                     where=f"the local hub cache ({constants.HF_HUB_CACHE}) does not hold it",
                     fix=f"point {what} at a local tokenizer folder")


def check_hub_dataset(name: str, *, cache_dir: str | None = None,
                      what: str = "data.source") -> None:
    """`check_hub_model` for a dataset given by hub name, read with ``datasets.load_dataset``:
    it passes when the datasets cache (``cache_dir``, else ``HF_DATASETS_CACHE``) holds a
    prepared copy (which ``datasets`` falls back on when the hub cannot be asked), or when the
    hub answers. Offline mode is ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE``.

    Args:
        name: the hub name (``owner/name``).
        cache_dir: the cache folder given to ``load_dataset`` (None: its default).
        what: the setting it came from (the message and the error's key).

    Raises:
        ConfigError: offline mode or an unreachable hub, and the datasets cache lacks it.
    """
    from datasets import config
    from datasets.naming import camelcase_to_snakecase

    root = os.path.expanduser(str(cache_dir or config.HF_DATASETS_CACHE))
    parts = name.split("/")
    folder = os.path.join(root, "___".join([*parts[:-1], camelcase_to_snakecase(parts[-1])]))
    # datasets keeps a prepared copy in <owner>___<name>/<config>/<version>/<hash>/
    if any(os.path.isdir(p) for p in glob.glob(os.path.join(glob.escape(folder), "*", "*", "*"))):
        return
    _refuse_uncached(f"the hub dataset {name!r}", what, flags=_DATASETS_OFFLINE,
                     where=f"the datasets cache ({root}) does not hold it",
                     fix=f"point {what} at local .jsonl/.parquet/.txt files or use "
                         f"{what}=builtin")


def cache_only(source: str) -> bool:
    """Whether transformers should read ``source`` from the local hub cache alone (its
    ``local_files_only``): ``source`` is a hub name, not a local path, and the hub cannot be
    asked now — offline mode, or no answer to `hub_answers`. Otherwise transformers asks an
    unreachable hub for every file, retrying for about 20 s each, before it reads the cache.

    A name the cache lacks was refused before (`check_hub_model`, `check_hub_tokenizer`); here
    it only makes transformers say so at once.
    """
    if os.path.exists(os.path.expanduser(source)) or not looks_like_hub_name(source):
        return False
    return _offline_flag(_TRANSFORMERS_OFFLINE) is not None or not hub_answers(hub_endpoint())


def hub_endpoint() -> str:
    """The hub huggingface_hub asks: ``HF_ENDPOINT``, else huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or _DEFAULT_HUB


@functools.lru_cache(maxsize=None)
def hub_answers(endpoint: str) -> bool:
    """Whether the hub at ``endpoint`` answers within `HUB_PROBE_TIMEOUT_S` (`_answers`), asked
    once per process and endpoint, so that the config, tokenizer and model loads of a run agree
    and an unreachable hub costs one probe, not one per load."""
    return _answers(endpoint, HUB_PROBE_TIMEOUT_S)


def _in_hub_cache(name: str, files: tuple[str, ...]) -> bool | None:
    """Whether the local hub cache holds one of ``files`` of the model repository ``name``;
    None when ``name`` is not a repository id huggingface_hub accepts (transformers will say
    so)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return any(isinstance(try_to_load_from_cache(name, f), str) for f in files)
    except ValueError:
        return None


def _refuse_uncached(subject: str, what: str, *, flags: tuple[str, ...], where: str,
                     fix: str) -> None:
    """Raise the one-sentence error for ``subject``, a hub name its cache lacks, when offline
    mode is set (no probe) or the hub does not answer; return when the hub answers.

    Args:
        subject: what could not be read, e.g. ``the tokenizer 'owner/name'``.
        what: the setting or option it came from; a recipe key is the error's key.
        flags: the environment variables that set offline mode for the library that reads it.
        where: the clause saying which cache lacks it.
        fix: what the user can do instead, as a clause.
    """
    key = None if what.startswith("-") else what
    head = f"Could not read {subject} ({what}): it is a hub name, but"
    flag = _offline_flag(flags)
    if flag is not None:
        raise ConfigError(f"{head} {flag} is set (offline mode) and {where}; download it while "
                          f"online, unset {flag}, or {fix}", key=key)
    endpoint = hub_endpoint()
    if not hub_answers(endpoint):
        raise ConfigError(f"{head} the hub {endpoint} cannot be reached from this machine and "
                          f"{where}; {fix}, or run where the hub can be reached", key=key)


def _offline_flag(flags: tuple[str, ...]) -> str | None:
    """The first of ``flags`` set to a true value (offline mode), or None."""
    return next((f for f in flags if _is_true(f)), None)


def _is_true(variable: str) -> bool:
    """Whether the environment variable is set to a true value, as huggingface_hub reads it."""
    return os.environ.get(variable, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _answers(url: str, timeout: float) -> bool:
    """Whether a server answers a HEAD request for ``url`` within ``timeout`` seconds (any HTTP
    status counts, and so does a TLS failure: something answered, and transformers will name
    what). Proxies set in the environment are used, as huggingface_hub uses them; the probe runs
    in a thread so that a name lookup that hangs cannot hold the caller past ``timeout``."""
    import ssl
    import threading
    import urllib.error
    import urllib.request

    answered: list[bool] = []

    def probe() -> None:
        try:
            request = urllib.request.Request(url, method="HEAD")
            urllib.request.urlopen(request, timeout=timeout).close()
            answered.append(True)
        except urllib.error.HTTPError:  # a status, e.g. 404: the server is there
            answered.append(True)
        except urllib.error.URLError as error:
            answered.append(isinstance(error.reason, ssl.SSLError))
        except ssl.SSLError:
            answered.append(True)
        except (OSError, ValueError):  # refused, timed out, no route; a malformed URL
            answered.append(False)

    thread = threading.Thread(target=probe, name="lctrain-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered) and answered[0]


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
