"""Hub names: whether a model, tokenizer or dataset given by hub name can be read here.

A model, tokenizer or dataset given by hub name must come from the hub or a local cache. When
neither can give it — offline mode (HF_HUB_OFFLINE) or a hub that does not answer within
`HUB_PROBE_TIMEOUT_S`, and no copy in the cache — `check_hub_model`, `check_hub_tokenizer` and
`check_hub_dataset` say so at once, where transformers and datasets would retry for about 20 s
and then fail in several lines. When the hub does not answer but the cache holds the name,
`cache_only` tells the loaders to read the cache at once instead of retrying first. The hub is
probed once per process (`hub_answers`). Standard library, and huggingface_hub's or datasets'
cache lookup when a name is checked.
"""
from __future__ import annotations

import functools
import glob
import os
import re

from lctrain.errors import ConfigError

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


def looks_like_hub_name(name: str) -> bool:
    """True for ``name`` or ``owner/name`` (the shapes of Hugging Face hub ids)."""
    return _HUB_NAME.fullmatch(name) is not None


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
