"""``lctrain bench data``: how long preparing a recipe's data takes on this machine, cold (fresh
caches: read, tokenize, write the token stream, plan rows) and warm (a later run's start, from
the caches), with the source's size and the rates."""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from lctrain.bench.result import BenchResult
from lctrain.config import RecipeConfig, local_data
from lctrain.report.versions import environment


@contextlib.contextmanager
def environment_folders(**folders: str | None) -> Iterator[None]:
    """Each variable set to its absolute folder (None: untouched) while the block runs."""
    saved = {name: os.environ.get(name) for name, folder in folders.items() if folder is not None}
    os.environ.update({name: os.path.abspath(folders[name]) for name in saved})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def caches_in(folder: str | os.PathLike | None) -> Iterator[None]:
    """lctrain's and datasets' caches in ``folder`` while the block runs (None: untouched);
    datasets reads its folder once, at import, so it is set there too."""
    if folder is None:
        yield
        return
    import datasets

    saved = datasets.config.HF_DATASETS_CACHE
    with environment_folders(XDG_CACHE_HOME=str(folder)):
        datasets.config.HF_DATASETS_CACHE = Path(folder, "hf")
        try:
            yield
        finally:
            datasets.config.HF_DATASETS_CACHE = saved


@contextlib.contextmanager
def fresh_caches() -> Iterator[None]:
    """lctrain's and datasets' caches in a temporary folder inside the block."""
    with tempfile.TemporaryDirectory(prefix="lctrain-bench-data-") as tmp, caches_in(tmp):
        yield


def run(cfg: RecipeConfig, progress: Callable[[str], None] | None = None) -> BenchResult:
    """One row: the source's records, bytes and tokens; cold and warm seconds; the rates."""
    from lctrain.data import prepare_data
    from lctrain.model import load_tokenizer

    say = progress or (lambda line: None)
    tokenizer = load_tokenizer(cfg)
    local = local_data(cfg.data.source)
    size = sum(os.path.getsize(f) for f in local.files) if local else None
    row = {"source": cfg.data.source, "megabytes": None if size is None else size / 2**20}
    with fresh_caches():
        for which in ("cold", "warm"):
            say(f"preparing {cfg.data.source} ({which})")
            start = time.perf_counter()
            rows = prepare_data(cfg.data, tokenizer)
            row[f"{which}_s"] = time.perf_counter() - start
    info = rows.info
    row.update(records=info["records"], tokens=info["tokens"], rows=len(rows),
               processes=info.get("processes"), tokens_per_s=info["tokens"] / row["cold_s"],
               status="ok")
    if size is not None:
        row["megabytes_per_s"] = row["megabytes"] / row["cold_s"]
    meta = {"machine": environment(), "seq_len": cfg.data.seq_len,
            "cores": len(os.sched_getaffinity(0)),
            "tokenizer": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__}
    return BenchResult(kind="data", title="data preparation", rows=[row], meta=meta)
