"""What the evaluation tests compare against: random text files, a tiny random Llama saved as a
model folder with the byte tokenizer's transformers twin, and plain transformers' eager loss of
each target token of a packed row."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch


def texts(path: Path, n: int, rng: random.Random, longest: int = 300) -> Path:
    """``n`` JSON lines of random words, each at most about ``longest`` characters."""
    words = ["alpha", "beta", "gamma", "delta", "long", "context", "tokens", "of", "the", "."]
    lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, longest
                                                                                      // 5)))})
             for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def save_tiny_model(folder: Path, seed: int) -> Path:
    """A tiny random Llama (GQA, untied head) with the byte tokenizer, as a model folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lctrain.export.write import byte_tokenizer_fast

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, vocab_size=260,
                         max_position_embeddings=1024, bos_token_id=256, eos_token_id=257,
                         pad_token_id=258, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the init's: logits that differ clearly
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(folder)
    byte_tokenizer_fast().save_pretrained(folder)
    return folder


def eager_model(folder):
    """The folder's model in plain transformers: eager attention, float32, on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def eager_losses(model, row) -> list[tuple[int, float]]:
    """(position, loss) of every target token of a packed row: plain transformers with eager
    attention, one document segment at a time (what the document mask means)."""
    out, start = [], 0
    ids, labels, positions = (torch.as_tensor(row[k]) for k in ("input_ids", "labels",
                                                                 "position_ids"))
    for n in row["doc_lens"].tolist():
        seg = slice(start, start + n)
        with torch.no_grad():
            logits = model(input_ids=ids[None, seg], position_ids=positions[None, seg]).logits[0]
        tok = torch.nn.functional.cross_entropy(logits.double(), labels[seg].clamp(min=0),
                                                reduction="none")
        for p, lab, loss in zip(positions[seg].tolist(), labels[seg].tolist(), tok.tolist()):
            if lab != -100:
                out.append((p, loss))
        start += n
    return out
