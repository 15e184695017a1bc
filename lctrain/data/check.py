"""A quick look at the data before any process starts: the first records of each local source,
read and encoded as preparing them would (`lctrain.data.prepare`), so a missing field or a bad
record is the same one-sentence DataError at once instead of after the ranks have started."""
from __future__ import annotations

import dataclasses
import functools
from itertools import islice
from typing import Any, Callable

from lctrain.config import DataConfig, local_data
from lctrain.data.formats import Encoder
from lctrain.data.prepare import no_tokens
from lctrain.data.records import RecordReader
from lctrain.errors import DataError

FIRST_RECORDS = 8
"""Records read and encoded per source."""


def check_first_records(data: DataConfig, tokenizer: Callable[[], Any]) -> None:
    """Read and encode the first `FIRST_RECORDS` records of data.source and data.eval_source with
    ``tokenizer()`` (loaded only for a local source); DataError as preparing would give. Builtin
    and hub sources are left to the ranks (a hub dataset is only read whole)."""
    tokenizer, sources = functools.cache(tokenizer), [(data, "data.source")]
    if isinstance(data.eval_source, str):
        sources.append((dataclasses.replace(data, source=data.eval_source, eval_source=None,
                                            max_documents=None), "data.eval_source"))
    for part, key in sources:
        if local_data(part.source, what=key) is None:
            continue
        records = list(islice(RecordReader(part, source_key=key), FIRST_RECORDS + 1))
        if not records:
            raise DataError(f"{key} {part.source!r} holds no record; point it at some data")
        encoder = Encoder.for_data(part, tokenizer(), records[0])
        if not encoder.encode(records[:FIRST_RECORDS]) and len(records) <= FIRST_RECORDS:
            raise no_tokens(part.source, encoder.skips, key)  # the whole source is read
