"""Training data: sources, tokenizers, packing into seq_len rows, batches and cp shards.

    tokenizer = load_tokenizer(cfg)
    rows = build_packed_dataset(cfg, tokenizer)        # input_ids, labels, position_ids, doc_lens
    for batch in iter_batches(rows, batch_size=1, dp_rank=0, dp_size=1, seed=0, start_step=0):
        local = shard_batch(batch, cp_rank=r, cp_size=p, layout=sched.layout)
"""
from lctrain.data.batches import PackedBatch, iter_batches, shard_batch
from lctrain.data.packing import IGNORE, build_packed_dataset, pack, pack_row, tokenize
from lctrain.data.sources import builtin_documents, load_documents
from lctrain.data.tokenizer import (
    BytePairTokenizer,
    ByteTokenizer,
    encode_documents,
    load_tokenizer,
    pad_token_id,
)

__all__ = [
    "IGNORE", "BytePairTokenizer", "ByteTokenizer", "PackedBatch", "build_packed_dataset", "builtin_documents",
    "encode_documents", "iter_batches", "load_documents", "load_tokenizer", "pack", "pack_row",
    "pad_token_id", "shard_batch", "tokenize",
]
