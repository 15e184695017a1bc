"""Hub names: whether a model, tokenizer or dataset given by hub name can be read here, said
at once in one sentence (offline, or the hub does not answer, and no cached copy) where
transformers and datasets would retry for about 20 s. The hub is probed once per process."""
from __future__ import annotations

import functools
import glob
import os
import re

from lctrain.errors import ConfigError

_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?")

HUB_PROBE_TIMEOUT_S = 3.0
"""How long `hub_answers` waits for the hub to answer before calling it unreachable."""
_TRANSFORMERS_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""The variables that set offline mode for transformers (models, configs, tokenizers)."""
_DATASETS_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
"""The variables that set offline mode for ``datasets.load_dataset``."""


def looks_like_hub_name(name: str) -> bool:
    """True for ``name`` or ``owner/name`` (the shapes of Hugging Face hub ids)."""
    return _HUB_NAME.fullmatch(name) is not None


def hub_split(source: str) -> tuple[str, str]:
    """A hub dataset's ``org/name[split]`` as (name, split); train where no split is named."""
    match = re.fullmatch(r"(.+)\[(\w[\w.\-]*)\]", source)
    return (match[1], match[2]) if match and looks_like_hub_name(match[1]) else (source, "train")


def check_hub_model(name: str, *, what: str = "model.path", files: tuple[str, ...] = (
        "config.json",), subject: str = "the config of model", local: str = "model") -> None:
    """Refuse at once (ConfigError) a hub name whose cache lacks ``files`` when offline or unanswered."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        if any(isinstance(try_to_load_from_cache(name, f), str) for f in files):
            return
    except ValueError:  # not a repository id
        return
    _refuse_uncached(f"{subject} {name!r}", what, flags=_TRANSFORMERS_OFFLINE,
                     where=f"the local hub cache ({constants.HF_HUB_CACHE}) does not hold it",
                     fix=f"point {what} at a local {local} folder")


def check_hub_dataset(name: str, *, cache_dir: str | None = None,
                      what: str = "data.source") -> None:
    """`check_hub_model` for a ``datasets`` dataset (its cache: ``cache_dir`` or the default)."""
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
                     fix=f"point {what} at local .jsonl/.parquet/.txt files or use {what}=builtin")


def cache_only(source: str) -> bool:
    """Whether transformers should read hub name ``source`` from the cache alone."""
    if os.path.exists(os.path.expanduser(source)) or not looks_like_hub_name(source):
        return False
    return _offline_flag(_TRANSFORMERS_OFFLINE) is not None or not hub_answers(hub_endpoint())


def hub_endpoint() -> str:
    """The hub huggingface_hub asks: ``HF_ENDPOINT``, else huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


@functools.lru_cache(maxsize=None)
def hub_answers(endpoint: str) -> bool:
    """Whether the hub at ``endpoint`` answers, asked once per process."""
    return _answers(endpoint, HUB_PROBE_TIMEOUT_S)


def _refuse_uncached(subject: str, what: str, *, flags: tuple[str, ...], where: str,
                     fix: str) -> None:
    """Raise the one-sentence error for ``subject`` when offline or the hub does not answer."""
    key = None if what.startswith("-") else what
    head = f"could not read {subject} ({what}): it is a hub name, but"
    flag = _offline_flag(flags)
    if flag is not None:
        raise ConfigError(f"{head} {flag} is set (offline mode) and {where}; download it while "
                          f"online, unset {flag}, or {fix}", key=key)
    endpoint = hub_endpoint()
    if not hub_answers(endpoint):
        raise ConfigError(f"{head} the hub {endpoint} cannot be reached from this machine and "
                          f"{where}; {fix}, or run where the hub can be reached", key=key)


def _offline_flag(flags: tuple[str, ...]) -> str | None:
    """The first of ``flags`` set to a true value as huggingface_hub reads it, or None."""
    return next((f for f in flags
                 if os.environ.get(f, "").strip().upper() in {"1", "ON", "YES", "TRUE"}), None)


def _answers(url: str, timeout: float) -> bool:
    """Whether a server answers a HEAD request for ``url`` within ``timeout`` (in a thread)."""
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
        except (OSError, ValueError) as error:  # refused, timed out, no route; a malformed URL
            reason = error.reason if isinstance(error, urllib.error.URLError) else None
            # but a status (e.g. 404) or a TLS failure: the server is there
            answered.append(isinstance(error, (urllib.error.HTTPError, ssl.SSLError))
                            or isinstance(reason, ssl.SSLError))

    thread = threading.Thread(target=probe, name="lctrain-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answered) and answered[0]
