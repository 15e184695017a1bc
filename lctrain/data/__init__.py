"""Training data: records in several formats, loss masks, a per-machine cache, rows, batches.

    tokenizer = load_tokenizer(cfg)
    rows = prepare_data(cfg.data, tokenizer, leader=local_rank == 0, show_progress=rank == 0)
    for batch in iter_batches(rows, batch_size=1, dp_rank=0, dp_size=1, seed=0, start_step=0):
        local = shard_batch(batch, cp_rank=r, cp_size=p, layout=sched.layout)

records.py reads sources with each record's location; formats.py turns records into token ids
and target flags (the loss mask; chat.py for chat templates); prepare.py writes them once into
the cache (cache.py) and plans the rows, of the training or the validation part (split.py);
packing.py assembles rows with labels shifted before any split; batches.py orders, batches and
shards them.
"""
from lctrain.data.batches import (PackedBatch, eval_batches, iter_batches, plan_steps,
                                  reorder_documents, shard_batch, steps_summary)
from lctrain.data.formats import FORMATS, Encoder, Sample, detect_format
from lctrain.data.packing import IGNORE, PackedRows, TokenStream, pack, plan_rows
from lctrain.data.prepare import prepare_data, rows_summary, tokenizer_identity
from lctrain.data.records import Record, RecordReader, builtin_documents
from lctrain.data.split import PARTS, held_out, part_samples
from lctrain.data.tokenizer import (
    BytePairTokenizer,
    ByteTokenizer,
    encode_documents,
    load_tokenizer,
    pad_token_id,
)

__all__ = [
    "FORMATS", "IGNORE", "PARTS", "BytePairTokenizer", "ByteTokenizer", "Encoder", "PackedBatch",
    "PackedRows", "Record", "RecordReader", "Sample", "TokenStream", "builtin_documents",
    "detect_format", "encode_documents", "eval_batches", "held_out", "iter_batches",
    "load_tokenizer", "pack", "pad_token_id", "part_samples", "plan_rows",
    "plan_steps", "prepare_data", "reorder_documents", "rows_summary", "shard_batch",
    "steps_summary",
    "tokenizer_identity",
]
