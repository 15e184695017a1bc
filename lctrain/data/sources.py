"""Where documents come from: the built-in corpus, local files, or a hub dataset.

Every source becomes a :class:`datasets.Dataset` with one document per row in a text column:

* ``builtin`` — the help topics that ship with Python itself (``pydoc_data.topics``): 79
  documents, about 0.5 MB of English prose and code, present offline on every machine;
* local files — ``.txt`` (each file is one document), ``.jsonl`` / ``.json`` / ``.parquet`` (each
  record is one document, text in ``data.text_field``), as one path or a glob;
* any other name — a Hugging Face hub dataset, read when the machine is online.
"""
from __future__ import annotations

import datasets

from lctrain.config import DataConfig, local_data
from lctrain.errors import DataError


def builtin_documents() -> list[str]:
    """The built-in corpus: every ``pydoc_data.topics`` help topic, sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def load_documents(data: DataConfig) -> tuple[datasets.Dataset, str]:
    """Read ``data.source`` into a Dataset and say which column holds the text.

    Returns:
        ``(dataset, text_column)``, limited to the first ``data.max_documents`` rows.

    Raises:
        DataError: no such files, the hub is unreachable, the text column is missing, or the
            source holds no document.
    """
    if data.source == "builtin":
        dataset, column = datasets.Dataset.from_dict({"text": builtin_documents()}), "text"
    else:
        dataset, column = _read(data), data.text_field
    if column not in dataset.column_names:
        raise DataError(f"data.text_field {column!r} is not a column of {data.source!r}; its "
                        f"columns are {dataset.column_names}")
    if data.max_documents is not None and data.max_documents < len(dataset):
        dataset = dataset.select(range(data.max_documents))
    if len(dataset) == 0:
        raise DataError(f"data.source {data.source!r} holds no document; point it at some text")
    return dataset, column


def _read(data: DataConfig) -> datasets.Dataset:
    local = local_data(data.source)
    in_memory = data.cache_dir is None
    if local is not None:
        extra = {"sample_by": "document"} if local.builder == "text" else {}
        try:
            return datasets.load_dataset(local.builder, data_files=local.files, split="train",
                                         cache_dir=data.cache_dir, keep_in_memory=in_memory, **extra)
        except Exception as error:  # noqa: BLE001 - any reader failure is the file's fault
            raise DataError(f"could not read data.source {data.source!r} as {local.builder} "
                            f"({_first_line(error)}); check the files") from None
    try:
        return datasets.load_dataset(data.source, split=data.split, cache_dir=data.cache_dir,
                                     keep_in_memory=in_memory)
    except Exception as error:  # noqa: BLE001 - offline, unknown name, no such split...
        raise DataError(f"could not load the hub dataset {data.source!r} split {data.split!r} "
                        f"({_first_line(error)}); without network, point data.source at local "
                        f".jsonl/.parquet/.txt files or use data.source=builtin") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
