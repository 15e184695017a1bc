"""Write the corpus that `lctrain bench data` is measured on: OUT/corpus.jsonl, documents of 2 to
12 paragraphs drawn (seed 0) from Python's help topics until it holds about MIB mebibytes, and OUT/tok,
a byte-level BPE tokenizer trained on those paragraphs. Prints the tokenizer's vocabulary size,
which model.config.vocab_size must match.

    python3 benchmarks/make_corpus.py OUT [MIB]
"""
import json
import random
import sys
from pathlib import Path

from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

out, mib = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 300
out.mkdir(parents=True, exist_ok=True)
paragraphs = [p for t in topics.values() for p in t.split("\n\n") if p.strip()]
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
bpe.train_from_iterator(paragraphs, trainers.BpeTrainer(
    vocab_size=32000, special_tokens=["<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
tokenizer.save_pretrained(out / "tok")
rng, size = random.Random(0), 0
with open(out / "corpus.jsonl", "w") as handle:
    while size < mib << 20:
        line = json.dumps({"text": "\n\n".join(rng.choice(paragraphs)
                                               for _ in range(rng.randint(2, 12)))}) + "\n"
        size += handle.write(line)
print(len(tokenizer))
