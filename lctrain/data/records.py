"""Reading a data source record by record, each record with its location for messages.

Sources (``data.source``): ``builtin`` (Python's own help topics, present offline), ``.jsonl``
(strict UTF-8, one object a line), ``.json`` (an array of objects, or JSON lines), ``.parquet``,
``.txt`` (one document a file), or a Hugging Face hub dataset name (``org/name[split]``)."""
from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

from lctrain.config import DataConfig, local_data
from lctrain.config.hub import check_hub_dataset, hub_split
from lctrain.errors import DataError

_BOM = b"\xef\xbb\xbf"


def builtin_documents() -> list[str]:
    """The built-in corpus: every ``pydoc_data.topics`` help topic, by topic name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


@dataclass(frozen=True)
class Record:
    """One record's fields and its location (``file:line``, ``file: row i``, ...)."""

    fields: dict[str, Any]
    where: str


class RecordReader:
    """The records of ``data.source`` (the first ``data.max_documents``); ``source_key`` is
    the recipe key named in messages. ``done`` of ``total`` tells how far reading has got (bytes
    of local JSON and text files, else records; total 0 when unknown)."""

    def __init__(self, data: DataConfig, *, source_key: str = "data.source") -> None:
        self.data, self.source_key, self.done = data, source_key, 0
        self.local = local_data(data.source)
        if self.local is None:
            self.total = len(builtin_documents()) if data.source == "builtin" else 0
        elif self.local.builder == "parquet":
            self.total = _parquet_rows(self.local.files)
        else:
            self.total = sum(os.path.getsize(f) for f in self.local.files)

    def __iter__(self) -> Iterator[Record]:
        return islice(self._records(), self.data.max_documents)

    def _records(self) -> Iterator[Record]:
        key = self.data.text_field
        if self.data.source == "builtin":
            from pydoc_data.topics import topics

            for name in sorted(topics):
                self.done += 1
                yield Record({key: topics[name]}, f"builtin topic {name!r}")
            return
        if self.local is None:
            yield from self._hub()
            return
        read = getattr(self, "_" + self.local.builder)  # _json, _parquet or _text
        for path in self.local.files:
            try:
                yield from read(path)
            except OSError as error:  # unreadable: a permission, a device or network error
                raise DataError(f"could not read {path} ({error.strerror or _first_line(error)});"
                                " check the file and its permissions") from None

    def _json(self, path: str) -> Iterator[Record]:
        if path.lower().endswith(".json"):
            whole = _json_document(path)
            if whole is not None:
                for i, fields in enumerate(whole):
                    yield Record(_object(fields, f"{path}: record {i}"), f"{path}: record {i}")
                self.done += os.path.getsize(path)
                return
        with open(path, "rb") as handle:
            for lineno, raw in enumerate(handle, 1):
                self.done += len(raw)
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                text = _utf8(raw.removeprefix(_BOM) if lineno == 1 else raw, where,
                             lineno_in_text=False)
                try:
                    fields = json.loads(text)
                except json.JSONDecodeError as error:
                    raise DataError(f"{where} is not valid JSON ({error.msg} at column "
                                    f"{error.colno}); fix or remove that line") from None
                yield Record(_object(fields, where), where)

    def _parquet(self, path: str) -> Iterator[Record]:
        pq = _optional("pyarrow.parquet", "pyarrow", ".parquet files")
        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
            for row, fields in enumerate(f for batch in batches for f in batch.to_pylist()):
                self.done += 1
                yield Record(fields, f"{path}: row {row}")
        except (OSError, ValueError) as error:  # pyarrow's errors derive from these
            raise DataError(f"could not read {path} as parquet ({_first_line(error)}); check "
                            f"the file") from None

    def _text(self, path: str) -> Iterator[Record]:
        raw = Path(path).read_bytes()
        self.done += len(raw)
        text = _utf8(raw.removeprefix(_BOM), path, lineno_in_text=True)
        yield Record({self.data.text_field: text}, path)

    def _hub(self) -> Iterator[Record]:
        datasets = _optional("datasets", "datasets", "hub datasets")
        name, split = hub_split(self.data.source)
        # refused at once when neither the hub nor the datasets cache can give it
        check_hub_dataset(name, what=self.source_key)
        try:
            dataset = datasets.load_dataset(name, split=split)
        except Exception as error:  # noqa: BLE001 - offline, unknown name, no such split...
            key = self.source_key
            raise DataError(f"could not load the hub dataset {name!r} split {split!r} "
                            f"({_first_line(error)}); without network, point {key} at local "
                            f".jsonl/.parquet/.txt files or use {key}=builtin") from None
        self.total = len(dataset)
        for i, fields in enumerate(dataset):
            self.done += 1
            yield Record(dict(fields), f"{name}[{split}] row {i}")


def _utf8(raw: bytes, where: str, *, lineno_in_text: bool) -> str:
    """``raw`` decoded as strict UTF-8, or a DataError naming the place of the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        place = f"{where}:{line}" if lineno_in_text else where
        raise DataError(f"{place} is not UTF-8 text (byte {raw[error.start]:#04x} at column "
                        f"{column}); convert the file to UTF-8") from None


def _json_document(path: str) -> list | None:
    """The records of a .json file holding one JSON array; None when it is JSON lines."""
    text = _utf8(Path(path).read_bytes().removeprefix(_BOM), path, lineno_in_text=True)
    if not text.lstrip().startswith("["):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno} is not valid JSON ({error.msg} at column "
                        f"{error.colno}); fix the file") from None


def _object(fields: Any, where: str) -> dict[str, Any]:
    if not isinstance(fields, dict):
        raise DataError(f"{where} is a JSON {type(fields).__name__}, not an object; each record "
                        f"must be an object such as {{\"text\": \"...\"}}")
    return fields


def _parquet_rows(files: list[str]) -> int:
    pq = _optional("pyarrow.parquet", "pyarrow", ".parquet files")
    try:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    except (OSError, ValueError) as error:
        raise DataError(f"could not read data.source files as parquet ({_first_line(error)}); "
                        f"check the files") from None


def _optional(module: str, package: str, what: str):
    """Import ``module``, or a DataError saying which package reading ``what`` needs."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs the {package} package, which is not installed; "
                        f"pip install {package}, or convert the data to .jsonl") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def source_identity(data: DataConfig) -> list:
    """The source's identity for the cache key (local files: path, size, modification time)."""
    if data.source == "builtin":
        return ["builtin", sys.version, sum(len(t) for t in builtin_documents())]
    local = local_data(data.source)
    if local is None:
        return ["hub", *hub_split(data.source)]
    stats = [(os.path.abspath(f), os.stat(f)) for f in local.files]
    return [[path, st.st_size, st.st_mtime_ns] for path, st in stats]
