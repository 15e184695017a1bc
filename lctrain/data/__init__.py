"""Training data: records → samples with loss masks → a per-machine cache → rows → batches.

    rows = prepare_data(cfg.data, tokenizer, leader=local_rank == 0)
    for batch in iter_batches(rows, batch_size=1, dp_rank=0, dp_size=1, seed=0):
        local = shard_batch(batch, cp_rank=r, cp_size=p, layout=layout)
"""
from lctrain.data.formats import FORMATS, Encoder, Sample, detect_format
from lctrain.data.packing import (IGNORE, PackedBatch, PackedRows, TokenStream, eval_batches,
                                  iter_batches, pack, plan_rows, plan_steps, reorder_documents,
                                  shard_batch, steps_summary)
from lctrain.data.prepare import (PARTS, held_out, part_samples, prepare_data, rows_summary,
                                  tokenizer_identity)
from lctrain.data.records import Record, RecordReader, builtin_documents
from lctrain.data.tokenizer import (BytePairTokenizer, ByteTokenizer, encode_documents,
                                    load_tokenizer, pad_token_id)
