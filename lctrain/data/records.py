"""Reading a data source record by record, each record with the place it came from.

A record is one sample before tokenization: a mapping of field names to values
(``{"text": ...}``, ``{"prompt": ..., "completion": ...}``, ``{"messages": [...]}``,
``{"input_ids": [...]}``). Each comes with its location — ``file:line`` for JSON lines,
``file: record i`` for a JSON array, ``file: row i`` for parquet, the file for a .txt document,
``builtin topic 'name'``, ``name[split] row i`` for a hub dataset — so that every error and every
skipped record can be named.

Sources (``data.source``):

* ``builtin`` — the help topics that ship with Python itself (``pydoc_data.topics``): 79
  documents, about 0.5 MB of English prose and code, present offline on every machine;
* ``.jsonl`` — one JSON object per line, strict UTF-8 (a byte-order mark is allowed); blank
  lines are not records; a line that is not UTF-8, not JSON or not an object is an error;
* ``.json`` — a JSON array of objects, or JSON lines;
* ``.parquet`` — one record per row;
* ``.txt`` — each file is one document (its text under ``data.text_field``), strict UTF-8;
* any other name — a Hugging Face hub dataset, read through ``datasets`` from the hub or the
  datasets cache; refused at once when neither can give it
  (`lctrain.config.hub.check_hub_dataset`).

`RecordReader.done` / ``total`` tell how far reading has got (bytes for JSON and text files,
records otherwise), which is what the preparation's progress display shows.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

from lctrain.config import DataConfig, local_data
from lctrain.config.hub import check_hub_dataset
from lctrain.errors import DataError


def builtin_documents() -> list[str]:
    """The built-in corpus: every ``pydoc_data.topics`` help topic, sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


@dataclass(frozen=True)
class Record:
    """One record of the source and where it is."""

    fields: dict[str, Any]
    """The record's fields."""
    where: str
    """Its location, for messages: ``file:line``, ``file: row i``, ..."""


class RecordReader:
    """Iterate over the records of ``data.source`` (the first ``data.max_documents`` of them).

    ``source_key`` is the recipe key the source was set by (``data.eval_source`` for validation
    rows prepared from their own source), named in messages.

    Attributes:
        total: the size of the source in ``unit`` (bytes of local JSON / text files, else
            records; 0 when unknown).
        done: how much of it has been read so far.
        unit: ``"B"`` or ``"records"``.
    """

    def __init__(self, data: DataConfig, *, source_key: str = "data.source") -> None:
        self.data = data
        self.source_key = source_key
        self.local = local_data(data.source)
        self.done = 0
        if self.local is None:
            builtin = data.source == "builtin"
            self.total, self.unit = (len(builtin_documents()) if builtin else 0), "records"
        elif self.local.builder == "parquet":
            self.total, self.unit = _parquet_rows(self.local.files), "records"
        else:
            self.total, self.unit = sum(os.path.getsize(f) for f in self.local.files), "B"

    def __iter__(self) -> Iterator[Record]:
        limit = self.data.max_documents
        for count, record in enumerate(self._records()):
            if limit is not None and count >= limit:
                return
            yield record

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
        readers = {"json": self._json, "parquet": self._parquet, "text": self._text}
        read = readers[self.local.builder]
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
                text = _utf8(raw[3:] if lineno == 1 and raw.startswith(b"\xef\xbb\xbf") else raw,
                             where, lineno_in_text=False)
                try:
                    fields = json.loads(text)
                except json.JSONDecodeError as error:
                    raise DataError(f"{where} is not valid JSON ({error.msg} at column "
                                    f"{error.colno}); fix or remove that line") from None
                yield Record(_object(fields, where), where)

    def _parquet(self, path: str) -> Iterator[Record]:
        pq = _optional("pyarrow.parquet", "pyarrow", ".parquet files")
        row = 0
        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
            for batch in batches:
                for fields in batch.to_pylist():
                    self.done += 1
                    yield Record(fields, f"{path}: row {row}")
                    row += 1
        except (OSError, ValueError) as error:  # pyarrow's errors derive from these
            raise DataError(f"could not read {path} as parquet ({_first_line(error)}); check "
                            f"the file") from None

    def _text(self, path: str) -> Iterator[Record]:
        with open(path, "rb") as handle:
            raw = handle.read()
        self.done += len(raw)
        text = _utf8(raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw, path, lineno_in_text=True)
        yield Record({self.data.text_field: text}, path)

    def _hub(self) -> Iterator[Record]:
        datasets = _optional("datasets", "datasets", "hub datasets")
        name, split = self.data.source, self.data.split
        # refused at once when neither the hub nor the datasets cache can give it
        check_hub_dataset(name, cache_dir=self.data.cache_dir, what=self.source_key)
        try:
            dataset = datasets.load_dataset(name, split=split, cache_dir=self.data.cache_dir)
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
    with open(path, "rb") as handle:
        raw = handle.read()
    text = _utf8(raw[3:] if raw.startswith(b"\xef\xbb\xbf") else raw, path, lineno_in_text=True)
    if not text.lstrip().startswith("["):
        return None
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno} is not valid JSON ({error.msg} at column "
                        f"{error.colno}); fix the file") from None
    return records


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
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"reading {what} needs the {package} package, which is not installed; "
                        f"pip install {package}, or convert the data to .jsonl") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def source_identity(data: DataConfig) -> list:
    """What identifies the source's content cheaply, for the cache key: each local file's
    absolute path, size and modification time; the built-in corpus's text length and Python
    version; a hub dataset's name and split."""
    if data.source == "builtin":
        import sys

        return ["builtin", sys.version, sum(len(t) for t in builtin_documents())]
    local = local_data(data.source)
    if local is None:
        return ["hub", data.source, data.split]
    stats = [(os.path.abspath(f), os.stat(f)) for f in local.files]
    return [[path, st.st_size, st.st_mtime_ns] for path, st in stats]
