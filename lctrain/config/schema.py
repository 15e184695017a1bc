"""The typed recipe: one frozen, keyword-only dataclass per YAML section (``train`` and
``checkpoint`` in :mod:`lctrain.config.training`), every value checked in ``__post_init__``."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

from lctrain.config.fields import SIZE, at_least, check_fields, require, suggest
from lctrain.config.training import CheckpointConfig, TrainConfig
from lctrain.errors import ConfigError
from lctrain_kernels.vocabulary import BACKENDS, check_seq_len, schedule_layout, seq_chunks

SCHEDULE_LAYOUTS = {kind: schedule_layout(kind) for kind in ("distflash", "zigzag")}
"""The product's attention schedules and the sequence layout each expects."""

ATTENTION_BACKENDS = ("auto", *BACKENDS)
"""Local attention backends of lctrain_kernels, and "auto" (the fastest that can run)."""

BYTE_TOKENIZER_VOCAB = 259
"""Vocabulary of the ``bytes`` tokenizer: 256 byte values + bos, eos, pad."""
BYTE_PAIR_TOKENIZER_VOCAB = 65795
"""Vocabulary of the ``byte-pairs`` tokenizer: 65,536 pairs + 256 lone bytes + bos, eos, pad."""
FIELD_NAMES = ("text", "messages", "role", "content", "prompt", "completion", "instruction",
               "input", "output", "system", "user", "assistant", "tool")
"""The names ``data.fields`` maps to a dataset's (record fields, message keys, roles)."""
BUILTIN_TOKENIZERS = {"bytes": BYTE_TOKENIZER_VOCAB, "byte-pairs": BYTE_PAIR_TOKENIZER_VOCAB}
"""``data.tokenizer`` values that need no tokenizer files -> the vocabulary they need."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to fine-tune: a pretrained one (``path``) or a random init (``config``)."""

    path: str | None = None
    """Local model folder (config.json, weights, tokenizer) or a hub name; recipes for real
    models ship a placeholder in angle brackets."""
    config: dict | None = None
    """Without ``path``: a transformers config (with ``model_type``) for a random init; with it,
    overrides of its config.json that keep the weights' shapes (RoPE as ``rope_parameters``)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Data type the model's parameters are created or loaded in."""
    trust_remote_code: bool = False
    """Allow model / tokenizer code from the model folder or the hub to run."""
    fused_kernels: bool = True
    """On GPUs, Liger-Kernel's fused RMSNorm, RoPE, SwiGLU and linear cross-entropy, lctrain's
    attention projections in the head groups and norms deferred into their readers (Llama,
    Mistral, Qwen); false: transformers' own layers and the chunked loss."""

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if self.path is None and self.config is None:
            raise ConfigError("the recipe names no model; set model.path (a pretrained model "
                              "folder) or model.config (a random init)", key="model.path")
        require(self.path != "", "model.path", "is empty; give a local folder or a hub name")
        if self.path is None and not isinstance(self.config.get("model_type"), str):
            raise ConfigError("model.path is not set and model.config has no model_type; set "
                              "model.path to a pretrained model's folder, or give model.config a "
                              "model_type (e.g. model_type: llama) to build a random init",
                              key="model.config")
        if self.config is not None:
            check_model_shapes(self.config, "model.config")

    @property
    def random_init(self) -> bool:
        """True when the model is built from ``config`` with random weights (no ``path``)."""
        return self.path is None


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the training text comes from and how it becomes rows of tokens."""

    source: str = "builtin"
    """``builtin`` (Python's help topics), .txt/.jsonl/.json/.parquet files, a glob or hub name
    (``org/name[validation]`` reads that split; train without brackets)."""
    format: Literal["auto", "text", "prompt_completion", "chat", "tokenized"] = "auto"
    """What a record holds: text, prompt_completion (loss on the completion; Alpaca too), chat
    (loss on the assistant turns; ShareGPT too), tokenized (input_ids, labels); auto: detected."""
    fields: dict | None = None
    """The records' names where they differ from ours (ours: theirs): text, messages, role,
    content, prompt, completion, instruction, input, output, roles system, user, assistant, tool."""
    chat_template: str | None = None
    """chatml, llama3, qwen2, mistral, gemma or a .jinja file (null: the tokenizer's); it also
    renders prompt_completion records as a user and an assistant turn; exports carry it."""
    turns: Literal["all", "last", "all_or_skip", "last_or_skip"] = "all"
    """Assistant turns trained on: all or the last; a chat without one is an error, or with
    *_or_skip skipped and counted."""
    tokenizer: str | None = None
    """null: model.path's; a tokenizer folder or hub name; for a random init bytes or byte-pairs."""
    seq_len: int = field(default=4096, metadata=SIZE | at_least(2))
    """Tokens per packed row (the context length trained on); sizes such as 256k."""
    long_samples: Literal["auto", "split", "truncate_left", "truncate_right", "drop"] = "auto"
    """split: samples end to end, a row every seq_len tokens; the others keep samples whole
    and cut a longer one's start or end, or drop it; auto: drop where a loss mask matters."""
    document_mask: bool = True
    """Keep packed documents apart: attention, positions and labels stop at each boundary."""
    max_documents: int | None = field(default=None, metadata=at_least(1, " (or null for all)"))
    """Use only the first N records of the source (null = all)."""
    eval_source: str | float | None = None
    """Validation data, prepared like data.source (logged as eval_loss), or a number in (0, 1):
    the share of data.source's documents held out, chosen by train.seed."""

    def __post_init__(self) -> None:
        check_fields(self, "data")
        require(self.source.strip() != "", "data.source", "is empty; use builtin, a file or a hub name")
        for ours, theirs in (self.fields or {}).items():
            require(ours in FIELD_NAMES, f"data.fields.{ours}", "is not one of our names; map "
                    f"{', '.join(FIELD_NAMES)} to the records' names{suggest(ours, FIELD_NAMES)}")
            require(isinstance(theirs, str) and theirs != "", f"data.fields.{ours}",
                    f"is {theirs!r} but must be the records' name for {ours} (a string)")
        require(self.chat_template != "", "data.chat_template", "is empty; name a template, a "
                ".jinja file or null")
        require(self.tokenizer != "", "data.tokenizer", "is empty; use bytes, a path or null")
        require(self.eval_source != "", "data.eval_source", "is empty; give a file or a share")
        share = self.eval_source
        require(share is None or isinstance(share, str) or 0 < share < 1, "data.eval_source",
                f"is {share!r} but a share of documents held out must be in (0, 1), e.g. 0.05")

    @property
    def has_eval(self) -> bool:
        """Whether validation data is set (data.eval_source: a source or a share)."""
        return self.eval_source is not None

    @property
    def eval_fraction(self) -> float:
        """The share of data.source's documents held out (0 where data.eval_source is not one)."""
        return self.eval_source if isinstance(self.eval_source, float) else 0.0

    @property
    def text_field(self) -> str:
        """The records' field holding a text document (data.fields.text)."""
        return (self.fields or {}).get("text", "text")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the work is spread: cp ranks per sequence, world size / cp over the batch."""

    cp: int = field(default=1, metadata=at_least(1))
    """Ranks that share one sequence (each holds seq_len / cp tokens)."""
    schedule: Literal[tuple(SCHEDULE_LAYOUTS)] = "distflash"
    """distflash (balanced) or zigzag (a ring over the head-tail layout)."""
    attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    """Local attention backend of lctrain_kernels; auto picks the fastest that can run."""
    fsdp: Literal["auto", "on", "off"] = "auto"
    """Shard parameters, gradients and AdamW states over all ranks (auto: on several GPUs)."""
    head_groups: int = field(default=1, metadata=at_least(1))
    """Run the heads in this many groups one after another (a divisor of the key/value
    heads): the attention's buffers shrink by that factor."""

    def __post_init__(self) -> None:
        if self.schedule in ("ring", "context_parallel"):
            raise ConfigError(f"parallel.schedule {self.schedule} is no longer a training "
                              "schedule: lctrain bench attention --peers compares it with "
                              "distflash; use distflash or zigzag", key="parallel.schedule")
        check_fields(self, "parallel")

    @property
    def layout(self) -> str:
        """The sequence layout the chosen schedule expects (``contiguous`` or ``zigzag``)."""
        return SCHEDULE_LAYOUTS[self.schedule]

    @property
    def seq_chunks(self) -> int:
        """Number of equal chunks the sequence is cut into: seq_len must be a multiple of it."""
        return seq_chunks(self.cp, self.layout)


LORA_ALL_LINEAR = "all-linear"
"""``lora.target_modules`` value meaning every linear layer of the decoder layers."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters (peft) instead of training every weight; rank 0 = off."""

    rank: int = field(default=0, metadata=at_least(0, " (0 = LoRA off)"))
    """Rank r of every adapter (ΔW = B·A·alpha/r); 0 = off (the others then stay default)."""
    alpha: float | None = None
    """Scale numerator of the adapters' update; null = 2 × rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    target_modules: tuple[str, ...] = (LORA_ALL_LINEAR,)
    """Linear layers that get adapters, e.g. [q_proj, v_proj], or all-linear."""
    trainable_modules: tuple[str, ...] = ()
    """Modules trained fully beside the adapters, e.g. [embed_tokens, norm] (LongLoRA)."""

    def __post_init__(self) -> None:
        check_fields(self, "lora")
        if self.rank == 0:
            for f in dataclasses.fields(self):
                require(f.name == "rank" or getattr(self, f.name) == f.default, f"lora.{f.name}",
                        "is set but lora.rank is 0 (LoRA off); set lora.rank (e.g. 16) to train "
                        "adapters, or leave the other lora settings at their defaults")
        require(self.alpha is None or self.alpha > 0, "lora.alpha",
                f"is {self.alpha} but must be positive (or null for 2 × rank)")
        require(0 <= self.dropout < 1, "lora.dropout", f"is {self.dropout} but must be in [0, 1)")
        require(len(self.target_modules) > 0, "lora.target_modules",
                "is empty; name the linear layers to adapt, or use all-linear")
        for key in ("target_modules", "trainable_modules"):
            for name in (names := getattr(self, key)):
                require(name != "" and name == name.strip() and " " not in name, f"lora.{key}",
                        f"holds {name!r}, which is not a module name; write names such as q_proj")
                require(names.count(name) == 1, f"lora.{key}", f"names {name} twice")
        require(LORA_ALL_LINEAR not in self.target_modules or len(self.target_modules) == 1,
                "lora.target_modules", f"mixes {LORA_ALL_LINEAR} with other names; use "
                f"{LORA_ALL_LINEAR} alone or list the layers")
        for name in self.trainable_modules:
            require(name not in self.target_modules, "lora.trainable_modules",
                    f"names {name}, which lora.target_modules adapts too; a module is either "
                    "adapted or fully trained")

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (rank > 0)."""
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """alpha, with null resolved to 2 × rank."""
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


@dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """A whole recipe: what to train, on what, how parallel, how long, how saved."""

    model: ModelConfig
    """The model section."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data section."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel section."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The train section."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """The checkpoint section."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The lora section (off unless lora.rank > 0)."""

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__} (a mapping in YAML)", key=name)
        try:
            check_seq_len(self.data.seq_len, self.parallel.cp, self.parallel.layout,
                          what="data.seq_len", ranks="parallel.cp")
        except ValueError as exc:
            raise ConfigError(str(exc), key="data.seq_len") from None
        _check_tokenizer(self)
        if self.data.document_mask and self.train.batch_size != 1:
            raise ConfigError(
                f"train.batch_size is {self.train.batch_size} but data.document_mask needs 1 "
                f"(attention takes one set of document boundaries per step); use "
                f"train.grad_accum={self.train.batch_size * self.train.grad_accum} instead or set "
                f"data.document_mask=false", key="train.batch_size")
        if self.train.eval_every and not self.data.has_eval:
            raise ConfigError(
                f"train.eval_every is {self.train.eval_every} but there is no validation data; "
                "set data.eval_source (a file, or a share of data.source such as 0.05), or "
                "train.eval_every=0", key="train.eval_every")
        if self.train.layers.state == "state" and self.parallel.fsdp == "off":
            raise ConfigError(
                "train.offload names state, which keeps the state on the host through FSDP2's "
                "CPU offload, but parallel.fsdp is off; set parallel.fsdp=auto (or on), or "
                "train.offload=optimizer", key="train.offload")

    def to_dict(self) -> dict:
        """The recipe as plain YAML-ready data (tuples become lists)."""
        return _plain(dataclasses.asdict(self))


SECTIONS = typing.get_type_hints(RecipeConfig)
"""The recipe's sections, in YAML order, and the dataclass each one becomes."""


def _check_tokenizer(cfg: RecipeConfig) -> None:
    """A pretrained model reads its own tokenizer's ids; a random init has no tokenizer of its own."""
    name = cfg.data.tokenizer
    if not cfg.model.random_init:
        if name in BUILTIN_TOKENIZERS:
            raise ConfigError(f"data.tokenizer is {name} but model.path is set, and a pretrained "
                              f"model understands only the ids of its own tokenizer; set "
                              f"data.tokenizer=null (the tokenizer in model.path) or the folder "
                              f"of a tokenizer that matches the model", key="data.tokenizer")
        return
    if name is None:
        raise ConfigError("data.tokenizer is null (use the model's tokenizer) but model.config is a "
                          "random init with no tokenizer; set data.tokenizer to bytes, byte-pairs "
                          "or a tokenizer folder", key="data.tokenizer")
    need, vocab = BUILTIN_TOKENIZERS.get(name), cfg.model.config.get("vocab_size")
    if need is not None and isinstance(vocab, int) and vocab < need:
        raise ConfigError(f"model.config.vocab_size is {vocab} but the {name} tokenizer needs at "
                          f"least {need}; raise it", key="model.config.vocab_size")


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


MODEL_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
"""transformers config fields that are sizes: positive whole numbers when given."""
MAX_LAYERS = 10_000
"""The most decoder layers a model may have (the memory model walks them one by one)."""


def check_model_shapes(config: dict, where: str) -> None:
    """ConfigError naming the field when the config (``where``) cannot build a model."""
    fields = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for name in MODEL_SIZES:
        value = fields.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value <= 0):
            raise ConfigError(f"{where}: {name} is {value!r} but must be a positive whole "
                              "number", key=f"model.config.{name}")
    layers = fields.get("num_hidden_layers")
    if layers is not None and layers > MAX_LAYERS:
        raise ConfigError(f"{where}: num_hidden_layers is {layers} but lctrain builds at most "
                          f"{MAX_LAYERS:,} layers (the deepest models have a few hundred); check "
                          f"the number", key="model.config.num_hidden_layers")
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not divisible by "
                          f"num_key_value_heads {kv}; use a divisor of {heads}",
                          key="model.config.num_attention_heads")
    hidden = fields.get("hidden_size")
    if hidden and heads and fields.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size {hidden} is not divisible by "
                          f"num_attention_heads {heads} (the head width); choose heads that "
                          f"divide {hidden}, or set head_dim", key="model.config.num_attention_heads")
