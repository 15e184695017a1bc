"""Training data: records → samples with loss masks → a per-machine cache → rows → batches.

    rows = prepare_data(cfg.data, tokenizer, leader=local_rank == 0)
    for batch in iter_batches(rows, batch_size=1, dp_rank=0, dp_size=1, seed=0):
        local = shard_batch(batch, cp_rank=r, cp_size=p, layout=layout)
"""
from lctrain.data.formats import Encoder
from lctrain.data.packing import (IGNORE, PackedBatch, PackedRows, epoch_order, eval_batches,
                                  iter_batches, pack, plan_steps, reorder_documents, shard_batch,
                                  steps_summary)
from lctrain.data.prepare import held_out, prepare_data, rows_summary
from lctrain.data.records import RecordReader, builtin_documents
from lctrain.data.tokenizer import (BytePairTokenizer, ByteTokenizer, encode_documents,
                                    load_tokenizer)
