"""The prepared-data cache: one folder per (source, tokenizer, format), written once per machine.

Layout under the cache root (``data.cache_dir``, default `default_cache_dir`)::

    <tokens key>/                 the token stream: written by ONE process, then only read
        meta.json                 what the preparation found (format, counts, skips); written last
        ids.bin                   int32 token ids of all samples end to end
        targets.bin               uint8 per token: 1 = trained on
        bounds.npy                int64 sample starts, then the total
        wheres.txt                each sample's record location, one per line
        rows-<rows key>.npz       a row plan (seq_len, long_samples): pieces of every row
    <tokens key>.lock             taken while a process writes into the folder above

The keys are hashes (`digest`) of everything the content depends on: the source's identity
(paths, sizes and modification times of local files), the tokenizer's (its full definition and
chat template), the format settings and lctrain's data layout version; the rows key adds
seq_len and the packing mode. Changing any of them makes a new folder; nothing is ever
overwritten in place. A folder appears by an atomic rename of a finished temporary one, so a
reader never sees half of it; a rows file likewise. Old folders are not deleted: remove the
cache root to reclaim the space.

Who writes: the process the caller names the leader (the runner picks each machine's local rank
0) takes the key's lock (``fcntl.flock``, so concurrent runs on one machine also build once) and
builds what is missing; the others poll until it is there and then memory-map it. If the
leader fails, the launcher stops the waiting ranks.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from lctrain.errors import DataError

LAYOUT_VERSION = 3
"""Bumped whenever what a cache folder holds (or how tokens are made) changes."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lctrain/data``, or ``~/.cache/lctrain/data``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lctrain" / "data"


def digest(parts: Any) -> str:
    """A short hex hash of JSON-serialisable ``parts`` (with the layout version)."""
    text = json.dumps([LAYOUT_VERSION, parts], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created if needed) inside the block.

    Raises:
        DataError: the folder cannot be written.
    """
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a+")
    except OSError as error:
        raise DataError(f"cannot write the data cache in {lock_path.parent} ({error.strerror}); "
                        f"set data.cache_dir to a writable folder") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_folder(folder: Path, build: Callable[[Path], None]) -> None:
    """Run ``build(tmp)`` into a fresh temporary folder, then rename it to ``folder``.

    A stale ``folder`` without ``meta.json`` (never produced by this code, but possible by
    hand) is replaced. The temporary folder is removed when ``build`` fails.
    """
    if folder.exists() and not (folder / "meta.json").exists():
        shutil.rmtree(folder)
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_file(path: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` for a temporary file beside ``path``, then rename it to ``path``."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def wait_for(path: Path, *, poll_s: float = 0.2) -> None:
    """Block until ``path`` exists (another process of this machine is writing it)."""
    while not path.exists():
        time.sleep(poll_s)
