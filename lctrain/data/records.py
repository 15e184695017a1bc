"""A data source as a Hugging Face ``datasets.Dataset``, each row with where it came from.

Sources (``data.source``): ``builtin`` (Python's own help topics, present offline), ``.jsonl`` /
``.json`` (objects one a line, or one array), ``.parquet``, ``.txt`` (one document a file), or
a hub dataset name (``org/name[split]``). Files and hub names load with
``datasets.load_dataset`` (converted to Arrow once, in datasets' cache). Where datasets' own
message would not say where a file is malformed, a line-by-line check names the line and column."""
from __future__ import annotations

import json
import os
import re
import sys
from bisect import bisect_right
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from lctrain.config import DataConfig, local_data
from lctrain.config.hub import check_hub_dataset, hub_split
from lctrain.config.paths import bad_byte
from lctrain.errors import DataError

_BOM = b"\xef\xbb\xbf"


def builtin_documents() -> list[str]:
    """The built-in corpus: every ``pydoc_data.topics`` help topic, by topic name."""
    return [topic for _, topic in sorted(_topics().items())]


@dataclass(frozen=True)
class Record:
    """One record's fields and its row in ``source``; a field missing from a record but present
    in others of its file is null, as in datasets. ``where`` names its place (``file:line``,
    ``file: row i``, ...), found only when a message or a sample needs it."""

    fields: dict[str, Any]
    row: int
    source: "RecordReader"

    @property
    def where(self) -> str:
        return self.source.locate(self.row)

    def gives(self, key: str) -> bool:
        """Whether the record itself has ``key``, null or not (JSON lines: its line re-read)."""
        return self.fields.get(key) is not None or key in self.source.given(self.row)


class RecordReader:
    """The records of ``data.source`` (the first ``data.max_documents``) as ``dataset``;
    ``source_key`` is the recipe key named in messages."""

    def __init__(self, data: DataConfig, *, source_key: str = "data.source") -> None:
        datasets = load_datasets()
        self.data, self.source_key = data, source_key
        local = local_data(data.source, what=source_key)
        if data.source == "builtin":
            loaded = [(datasets.Dataset.from_dict({data.text_field: builtin_documents()}),
                       "builtin", "topic")]
        elif local is None:
            loaded = [self._hub(datasets)]
        else:
            loaded = [self._file(datasets, local.builder, path) for path in local.files
                      if not _blank(path)] or [(datasets.Dataset.from_dict({}), "", "")]
        self.firsts = np.cumsum([0] + [len(d) for d, _, _ in loaded[:-1]]).tolist()
        self.parts = [(name, kind) for _, name, kind in loaded]  # from row self.firsts[i]
        self.dataset = _concatenate(datasets, [d for d, _, _ in loaded], data.source)
        if data.max_documents is not None and data.max_documents < len(self.dataset):
            self.dataset = self.dataset.select(range(data.max_documents))

    def _file(self, datasets, builder: str, path: str) -> tuple[Any, str, str]:
        kind = {"json": _json_kind(path), "parquet": "row", "text": "file"}[builder]
        options = {"sample_by": "document", "encoding": "utf-8-sig"} if builder == "text" else {}
        try:
            dataset = datasets.load_dataset(builder, data_files=[path], split="train", **options)
            dataset.data.table.validate(full=True)  # pyarrow keeps strings that are not UTF-8
        except Exception as error:  # noqa: BLE001 - pyarrow, JSON, decoding and OS errors
            check_file(path, kind)  # raises the DataError naming the line where one is found
            if "corresponds to no data" in str(error):  # datasets: every record is {}
                raise DataError(f"{path} has no field in any record; each record needs the text "
                                f"to train on, such as {{\"text\": \"...\"}}") from None
            what = " as parquet" if builder == "parquet" else ""
            raise DataError(f"could not read {path}{what} ({_first_line(error)}); check the "
                            f"file") from None
        if builder == "text" and self.data.text_field != "text":
            dataset = dataset.rename_column("text", self.data.text_field)
        return dataset, path, kind

    def _hub(self, datasets) -> tuple[Any, str, str]:
        name, split = hub_split(self.data.source)
        # refused at once when neither the hub nor the datasets cache can give it
        check_hub_dataset(name, what=self.source_key)
        try:
            return datasets.load_dataset(name, split=split), f"{name}[{split}]", "hub"
        except Exception as error:  # noqa: BLE001 - offline, unknown name, no such split...
            key = self.source_key
            raise DataError(f"could not load the hub dataset {name!r} split {split!r} "
                            f"({_first_line(error)}); without network, point {key} at local "
                            f".jsonl/.parquet/.txt files or use {key}=builtin") from None

    def _part(self, row: int) -> tuple[int, str, str]:
        """Row ``row``'s index in its part, the part's file or name and its kind of place."""
        i = bisect_right(self.firsts, row) - 1
        return (row - self.firsts[i], *self.parts[i])

    def locate(self, row: int) -> str:
        """Where row ``row`` of ``dataset`` came from."""
        at, name, kind = self._part(row)
        if kind == "line":
            return f"{name}:{_record_lines(name)[0][at]}"
        if kind == "topic":
            return f"builtin topic {sorted(_topics())[at]!r}"
        return {"file": name, "hub": f"{name} row {at}"}.get(kind, f"{name}: {kind} {at}")

    def given(self, row: int) -> dict[str, Any]:
        """The fields row ``row`` has in its file: a JSON line's own, else every column."""
        at, name, kind = self._part(row)
        if kind != "line":
            return dict.fromkeys(self.dataset.column_names)
        with open(name, "rb") as handle:
            handle.seek(int(_record_lines(name)[1][at]))
            return json.loads(handle.readline().removeprefix(_BOM))

    def records(self, batch: dict[str, list], rows: list[int]) -> list[Record]:
        """The records of a column ``batch`` of ``dataset`` (rows ``rows``)."""
        return [Record({k: v[i] for k, v in batch.items()}, row, self)
                for i, row in enumerate(rows)]

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[Record]:
        for row, fields in enumerate(self.dataset):
            yield Record(fields, row, self)


@cache
def load_datasets():
    """The datasets module, its progress bars and log off (preparation turns bars on; a file
    it cannot read is lctrain's one sentence, not datasets' log of it)."""
    try:
        import datasets
    except ImportError as error:
        raise DataError(f"reading data needs the datasets package, which cannot be imported "
                        f"({error}); pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def _blank(path: str) -> bool:
    """Whether a file holds nothing but white space (no record)."""
    try:
        return os.path.getsize(path) < 4096 and not Path(path).read_bytes().removeprefix(
            _BOM).strip()
    except OSError:  # unreadable: loading it says so
        return False


def _concatenate(datasets, parts: list, source: str):
    """The datasets of a source's files as one; a field some files lack, or give only null, is
    null there (of the kind the others give)."""
    features, null = {}, datasets.Value("null")
    for part in parts:
        features.update({k: v for k, v in part.features.items() if features.get(k, null) == null})
    for i, part in enumerate(parts):
        part = part.remove_columns([k for k, v in part.features.items()
                                    if v == null != features[k]])  # re-added below, typed
        for name in features.keys() - set(part.column_names):
            parts[i] = part = part.add_column(name, [None] * len(part), feature=features[name])
    try:
        return datasets.concatenate_datasets(parts)
    except ValueError as error:
        raise DataError(f"the files of {source!r} give a field different kinds of value "
                        f"({_first_line(error)}); make each field one kind in every file") from None


_SPACE = re.compile(r"\s*")


def _json_kind(path: str) -> str:
    """How a JSON file's records are placed: "record" for one array or objects written over
    several lines (datasets reads both; no line per record), else "line" (also for a file that
    cannot be read, whose load then says why)."""
    try:
        with open(path, "rb") as handle:
            if handle.read(4096).removeprefix(_BOM).lstrip().startswith(b"["):
                return "record"
            handle.seek(0)
            first = next((line for line in handle if line.strip()), b"{}")
        json.loads(first.removeprefix(_BOM))
    except OSError:
        return "line"
    except ValueError:  # the first record goes on past its line (or is not JSON: said later)
        return "record"
    return "line"


def _record_lines(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The 1-based line numbers and byte offsets of a JSON lines file's records (its lines
    that are not blank)."""
    stat = os.stat(path)
    return _lines(path, stat.st_size, stat.st_mtime_ns)


@cache
def _lines(path: str, size: int, mtime_ns: int) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, np.uint8)
    starts = np.concatenate([[0], np.flatnonzero(raw == ord("\n")) + 1])
    starts = starts[starts < raw.size]
    records = np.flatnonzero(np.maximum.reduceat(raw, starts) > ord(" "))  # a byte not space
    return records + 1, starts[records]


def check_file(path: str, kind: str) -> None:
    """The one-sentence DataError of a malformed local file (its line and column where it has
    lines); returns when this check finds nothing wrong."""
    try:
        raw = Path(path).read_bytes().removeprefix(_BOM)
    except OSError as error:  # unreadable: a permission, a device or network error
        raise DataError(f"could not read {path} ({error.strerror or _first_line(error)});"
                        " check the file and its permissions") from None
    if kind == "row":
        return
    text = _utf8(raw, path)
    if kind == "record":  # one array, or objects one after another over several lines
        values, decoder, at = [], json.JSONDecoder(), _SPACE.match(text).end()
        try:
            while at < len(text):
                value, at = decoder.raw_decode(text, at)
                values.append(value)
                at = _SPACE.match(text, at).end()
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{error.lineno} is not valid JSON ({error.msg} at column "
                            f"{error.colno}); fix the file") from None
        records = values[0] if len(values) == 1 and isinstance(values[0], list) else values
        for i, fields in enumerate(records):
            _object(fields, f"{path}: record {i}")
    if kind != "line":
        return
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            _object(json.loads(line), f"{path}:{lineno}")
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{lineno} is not valid JSON ({error.msg} at column "
                            f"{error.colno}); fix or remove that line") from None


def _object(fields: Any, where: str) -> None:
    if not isinstance(fields, dict):
        raise DataError(f"{where} is a JSON {type(fields).__name__}, not an object; each record "
                        f"must be an object such as {{\"text\": \"...\"}}")


def _utf8(raw: bytes, path: str) -> str:
    """``raw`` decoded as strict UTF-8, or a DataError naming the line and column of the first
    bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line, column = bad_byte(raw, error)
        raise DataError(f"{path}:{line} is not UTF-8 text (byte {raw[error.start]:#04x} at "
                        f"column {column}); convert the file to UTF-8") from None


def _first_line(error: BaseException) -> str:
    text = str(error.__cause__ or error).strip()
    name = type(error.__cause__ or error).__name__
    return f"{name}: {text.splitlines()[0]}" if text else name


def source_identity(data: DataConfig) -> list:
    """The source's identity for the cache key (local files: path, size, modification time)."""
    if data.source == "builtin":
        return ["builtin", sys.version, sum(len(t) for t in builtin_documents())]
    local = local_data(data.source)
    if local is None:
        return ["hub", *hub_split(data.source)]
    stats = [(os.path.abspath(f), os.stat(f)) for f in local.files]
    return [[path, st.st_size, st.st_mtime_ns] for path, st in stats]
