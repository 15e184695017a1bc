"""Names people bring from Hugging Face's Trainer, axolotl, LLaMA-Factory and TRL, and the
recipe setting each one means: the "did you mean" of an unknown key."""
from __future__ import annotations

ALIASES = {
    **dict.fromkeys(("learning_rate", "lr"), "train.lr"),
    **dict.fromkeys(("num_train_epochs", "num_epochs", "epochs"), "train.epochs"),
    "max_steps": "train.max_steps",
    **dict.fromkeys(("per_device_train_batch_size", "micro_batch_size", "train_batch_size",
                     "batch_size"), "train.batch_size"),
    "gradient_accumulation_steps": "train.grad_accum",
    **dict.fromkeys(("max_seq_length", "sequence_len", "max_seq_len", "max_length",
                     "seq_length", "model_max_length", "cutoff_len", "seq_len"), "data.seq_len"),
    **dict.fromkeys(("lora_r", "r", "rank"), "lora.rank"),
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    **dict.fromkeys(("lora_target_modules", "lora_target", "target_modules"),
                    "lora.target_modules"),
    **dict.fromkeys(("dataset", "datasets", "dataset_name", "train_file", "data_path",
                     "data_files"), "data.source"),
    "output_dir": "train.output_dir",
    "warmup_steps": "train.warmup_steps",
    "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm",
    "seed": "train.seed",
    **dict.fromkeys(("base_model", "model_name_or_path", "model_name", "model_path"),
                    "model.path"),
    "gradient_checkpointing": "train.checkpointing",
    **dict.fromkeys(("bf16", "fp16", "mixed_precision"), "train.mixed_precision"),
    **dict.fromkeys(("torch_dtype", "dtype"), "model.dtype"),
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
    "eval_steps": "train.eval_every",
    **dict.fromkeys(("tokenizer_name", "tokenizer", "tokenizer_name_or_path"), "data.tokenizer"),
    **dict.fromkeys(("sequence_parallel_degree", "context_parallel_size", "cp"), "parallel.cp"),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), "train.betas"),
    "report_to": "train.report_to",
    "trust_remote_code": "model.trust_remote_code",
}
"""A foreign setting name (the last part of a key) -> the recipe key that means it."""


def alias_hint(key: str) -> str:
    """``"; did you mean train.lr?"`` when the last part of ``key`` is a known foreign name of
    another setting, else ``""``."""
    target = ALIASES.get(key.rsplit(".", 1)[-1])
    return f"; did you mean {target}?" if target and target != key else ""
