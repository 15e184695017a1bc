"""The typed recipe: frozen, keyword-only dataclasses, one per YAML section.

A recipe YAML has the sections ``model``, ``data``, ``parallel``, ``train``, ``checkpoint`` and
``lora``; each maps onto one dataclass, field for field (``train`` and ``checkpoint`` in
:mod:`lctrain.config.training`, the others below). Every field has a docstring, every value is
checked in ``__post_init__`` (types by :mod:`lctrain.config.fields`, ranges and cross-field rules
here), so a :class:`RecipeConfig` that exists is a valid one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from lctrain.config.fields import SIZE, check_fields, require
from lctrain.config.model_shapes import check_model_shapes
from lctrain.config.training import CheckpointConfig, TrainConfig
from lctrain.errors import ConfigError
from lctrain_kernels.vocabulary import (BACKENDS, SCHEDULES, check_seq_len, schedule_layout,
                                        seq_chunks)

SCHEDULE_LAYOUTS = {**{kind: schedule_layout(kind) for kind in SCHEDULES},
                    "context_parallel": "zigzag"}
"""How each attention schedule lays the sequence out over the cp ranks: lctrain_kernels'
schedules (``lctrain_kernels.vocabulary``), and ``context_parallel``, torch's own ring
attention, the peer to compare with: its head-tail load balancer is the zigzag layout
(`lctrain.parallel.torch_cp` checks that at run time)."""

ATTENTION_BACKENDS = ("auto", *BACKENDS)
"""Local attention backends of lctrain_kernels, and "auto" (the fastest that can run)."""

BYTE_TOKENIZER_VOCAB = 259
"""Vocabulary of the ``"bytes"`` tokenizer: 256 byte values + bos, eos, pad (see lctrain.data)."""

BYTE_PAIR_TOKENIZER_VOCAB = 65795
"""Vocabulary of the ``"byte-pairs"`` tokenizer: 65,536 byte pairs + 256 lone bytes + bos, eos,
pad (see lctrain.data)."""

BUILTIN_TOKENIZERS = {"bytes": BYTE_TOKENIZER_VOCAB, "byte-pairs": BYTE_PAIR_TOKENIZER_VOCAB}
"""``data.tokenizer`` values that need no tokenizer files -> the vocabulary they need."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model to fine-tune: a pretrained one (``path``, with optional ``config`` overrides)
    or a random init (``config`` alone)."""

    path: str | None = None
    """Local model folder (config.json, *.safetensors, tokenizer files) or a hub name such as
    ``meta-llama/Llama-3.1-8B`` (hub only when online). Recipes for real models ship a
    placeholder in angle brackets (``<folder of Llama-3.1-8B>``) that training refuses until it
    is replaced."""
    config: dict | None = None
    """Without ``path``: a whole transformers config (with ``model_type``) for a randomly
    initialised model. With ``path``: overrides applied on top of the folder's config.json —
    RoPE scaling, ``max_position_embeddings``, dropout, sliding window, ... — which may not change
    the shapes of the folder's weights. RoPE is written as transformers 5 writes it,
    ``rope_parameters: {rope_type, rope_theta, factor, ...}``; the older ``rope_theta`` and
    ``rope_scaling`` keys are accepted too and folded into ``rope_parameters``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Data type the model's parameters are created or loaded in."""
    trust_remote_code: bool = False
    """Allow model / tokenizer code from the model folder or the hub to run."""
    fused_norms: bool = True
    """On GPUs, run the RMSNorm of Llama, Mistral and Qwen models as one Triton kernel each way
    (`lctrain.model.rms_norm`) instead of transformers' eager operations: same arithmetic,
    fewer passes over memory. false: transformers' own forward."""
    fused_rope: bool = True
    """On GPUs, apply the rotary position embedding of Llama, Mistral and Qwen models to q and k
    in one Triton kernel each way (`lctrain.model.rope`) instead of transformers' eager
    operations: the same formula, rounded once. false: transformers' own function."""
    fused_mlp: bool = True
    """On GPUs, compute the SiLU product of the gated MLP of Llama, Mistral and Qwen models in
    one Triton kernel each way (`lctrain.model.swiglu`) instead of transformers' eager
    operations: the same formula, rounded once, and one (tokens x intermediate) tensor less
    kept for the backward. false: transformers' own forward."""
    grouped_attention: bool = True
    """With parallel.head_groups > 1, run the q/k/v projections and RoPE of Llama, Mistral and
    Qwen2 attention modules in the head groups too (`lctrain.model.grouped_attention`), so no
    q, k, v or their gradients exist for all heads at once: less memory at long context for one
    more projection per layer and step. false: transformers' module, only the attention
    kernels in groups. LoRA-adapted projections always run transformers' module."""
    deferred_norms: bool = True
    """Run each Llama, Mistral or Qwen layer's RMSNorms inside the module that reads their
    output (`lctrain.model.deferred_norm`): the norm before the MLP inside the MLP's tiles
    (train.tile_tokens), the norm before the attention inside the grouped attention block
    (model.grouped_attention). The layer then keeps the norms' inputs, which it holds anyway,
    not their outputs, and the backward makes them again: less memory for one more norm per
    layer and step. false: the norms run on their own, before those modules."""
    fused_loss: bool = True
    """On GPUs, compute each chunk of the cross-entropy (`train.loss_chunk_tokens` tokens) and
    its logits' gradient in one Triton kernel (`lctrain.train.loss_kernel`), with no float32
    copy of the logits, and sum the head's gradient in float32 inside its matrix product.
    false: torch operations on a float32 copy, as on a CPU."""

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
    """``builtin`` (Python's own documentation topics, offline everywhere), a local file or glob
    (.txt = one document per file, .jsonl / .json / .parquet = one record per line / element /
    row) or a hub dataset name (when online)."""
    split: str = "train"
    """Split to read from a hub dataset."""
    format: Literal["auto", "text", "prompt_completion", "chat", "tokenized"] = "auto"
    """What a record holds and which of its tokens are trained on: ``text`` (the text in
    text_field; every token), ``prompt_completion`` (``prompt`` and ``completion`` strings; loss
    on the completion only), ``chat`` (a ``messages`` list of {role, content} rendered with the
    tokenizer's chat template; loss on the assistant turns only), ``tokenized`` (``input_ids``
    and optional ``labels``, -100 = no loss, as transformers models take them); ``auto``
    detects it from the first record's fields."""
    text_field: str = "text"
    """Field holding each document's text (the text format)."""
    tokenizer: str | None = None
    """null (the default): the tokenizer stored in model.path. Otherwise a tokenizer folder or
    hub name, or one of the tokenizers that need no files, for random-init models only:
    ``bytes`` (UTF-8 bytes, 259 ids) or ``byte-pairs`` (two bytes a token, 65,795 ids: fills
    most of a large vocabulary, as a benchmark twin of a real model should)."""
    seq_len: int = field(default=4096, metadata=SIZE)
    """Tokens per packed row (the context length trained on); accepts sizes such as 256k."""
    long_samples: Literal["auto", "split", "truncate_left", "truncate_right", "drop"] = "auto"
    """How samples become rows, and what happens to one longer than seq_len. ``split``: all
    samples end to end, a row cut every seq_len tokens, a long sample continuing in the next
    row (nothing is lost). The others keep every sample whole inside one row (rows filled
    best-fit, the rest padded) and treat a longer one by keeping its last (``truncate_left``) or
    first (``truncate_right``) seq_len tokens, or by leaving it out (``drop``). ``auto``: split
    for text and for tokenized records without labels, drop for the formats with a loss mask."""
    document_mask: bool = True
    """Keep packed documents apart: attention never crosses a document boundary, position ids
    restart per document and no label points into the next document."""
    max_documents: int | None = None
    """Use only the first N records of the source (null = all)."""
    cache_dir: str | None = None
    """Folder of the prepared-data cache: tokenized and packed once per machine (by its local
    rank 0), reused by the other ranks and by later runs with the same source files, tokenizer
    and settings; null = ``$XDG_CACHE_HOME/lctrain/data`` (``~/.cache/lctrain/data``)."""
    eval_source: str | None = None
    """Validation data, a source like data.source prepared with the same settings (logged as
    eval_loss); or use eval_fraction, not both."""
    eval_fraction: float = 0.0
    """Share of data.source's documents held out for validation, chosen by eval_seed; 0 = none."""
    eval_seed: int = 0
    """Seed of the documents eval_fraction holds out (the same in every run)."""

    def __post_init__(self) -> None:
        check_fields(self, "data")
        require(self.source.strip() != "", "data.source", "is empty; use builtin, a file or a hub name")
        require(self.text_field != "", "data.text_field", "is empty; name the text column")
        require(self.tokenizer != "", "data.tokenizer", "is empty; use bytes, a path or null")
        require(self.seq_len >= 2, "data.seq_len", f"is {self.seq_len} but must be at least 2")
        if self.max_documents is not None:
            require(self.max_documents >= 1, "data.max_documents",
                    f"is {self.max_documents} but must be at least 1 (or null for all)")
        require(self.eval_source != "", "data.eval_source", "is empty; give a file or null")
        require(0 <= self.eval_fraction < 1, "data.eval_fraction",
                f"is {self.eval_fraction} but must be in [0, 1) (0 = hold out nothing)")
        require(self.eval_source is None or self.eval_fraction == 0, "data.eval_fraction",
                f"is {self.eval_fraction} but data.eval_source is set too; validate on one: set "
                "data.eval_fraction=0 or data.eval_source=null")

    @property
    def has_eval(self) -> bool:
        """Whether validation data is set (data.eval_source or data.eval_fraction)."""
        return self.eval_source is not None or self.eval_fraction > 0


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the work is spread: cp ranks split each sequence, dp groups split the batch."""

    cp: int = 1
    """Context-parallel degree: ranks that share one sequence (each holds seq_len / cp tokens)."""
    dp: int = 0
    """Data-parallel degree; 0 = world size / cp."""
    schedule: Literal[tuple(SCHEDULE_LAYOUTS)] = "distflash"
    """Distributed attention schedule: distflash (balanced), ring (unbalanced baseline),
    zigzag (ring over the head-tail layout), or context_parallel — torch's own
    ``torch.distributed.tensor.experimental.context_parallel`` ring on SDPA, the peer to
    measure against (CUDA only, one causal sequence per row: data.document_mask false)."""
    attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    """Local attention backend of lctrain_kernels; auto picks the fastest that can run."""
    fsdp: Literal["auto", "on", "off"] = "auto"
    """Shard parameters, gradients and optimizer state (FSDP2) over all ranks; auto = on when
    there is more than one rank."""
    head_groups: int = 1
    """Run the attention heads in this many groups, one after the other (a divisor of the
    model's key/value heads): the attention's buffers (received keys/values, float32
    accumulators, gradients) shrink by that factor; same results (lctrain's schedules). With
    ``model.grouped_attention`` the q/k/v projections and RoPE run in the groups too."""
    balance_documents: bool = True
    """With packed documents and cp > 1, put each row's documents in the order that evens out
    the ranks' attention work under the schedule (lctrain_kernels.distributed.balance);
    attention never crosses a document, so the losses are those of the packed order."""

    def __post_init__(self) -> None:
        check_fields(self, "parallel")
        require(self.cp >= 1, "parallel.cp", f"is {self.cp} but must be at least 1")
        require(self.head_groups >= 1, "parallel.head_groups",
                f"is {self.head_groups} but must be at least 1")
        require(self.dp >= 0, "parallel.dp", f"is {self.dp} but must be 0 (auto) or more")

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
    """Low-rank adapters (LoRA, through peft) instead of training every weight; rank 0 = off.

    Module names match as in peft: a module matches a name when its qualified name is the name
    or ends in ``.name`` (``q_proj`` matches every layer's query projection, ``norm`` only the
    final norm). Names are checked against the model when it is built."""

    rank: int = 0
    """Rank r of every adapter (ΔW = B·A·alpha/r, A: r × in, B: out × r); 0 = LoRA off, every
    weight trains (the other lora settings must then stay at their defaults)."""
    alpha: float | None = None
    """Scale numerator of the adapters' update; null = 2 × rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    target_modules: tuple[str, ...] = (LORA_ALL_LINEAR,)
    """Linear layers that get adapters, by name (e.g. [q_proj, k_proj, v_proj, o_proj]);
    ``all-linear`` = every linear layer of the decoder layers. The output head cannot be one."""
    trainable_modules: tuple[str, ...] = ()
    """Modules trained fully alongside the adapters, e.g. [embed_tokens, input_layernorm,
    post_attention_layernorm, norm]: LongLoRA's trainable embeddings and norms, which context
    extension with LoRA needs."""

    def __post_init__(self) -> None:
        check_fields(self, "lora")
        require(self.rank >= 0, "lora.rank", f"is {self.rank} but must be ≥ 0 (0 = LoRA off)")
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
            _check_module_names(f"lora.{key}", getattr(self, key))
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
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__} (a mapping in YAML)", key=name)
        _check_seq_len(self)
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
                "set data.eval_source or data.eval_fraction, or train.eval_every=0",
                key="train.eval_every")
        if self.train.state_offload == "all" and self.parallel.fsdp == "off":
            raise ConfigError(
                "train.state_offload is all, which keeps the state on the host through FSDP2's "
                "CPU offload, but parallel.fsdp is off; set parallel.fsdp=auto (or on), or "
                "train.state_offload=optimizer", key="train.state_offload")
        if self.parallel.schedule == "context_parallel" and self.parallel.head_groups != 1:
            raise ConfigError(
                f"parallel.head_groups is {self.parallel.head_groups} but torch's ring attention "
                "(parallel.schedule context_parallel) runs all heads at once; set "
                "parallel.head_groups=1", key="parallel.head_groups")
        if self.parallel.schedule == "context_parallel" and self.data.document_mask:
            raise ConfigError(
                "parallel.schedule context_parallel (torch's ring attention) has no document "
                "mask: it attends causally across the packed documents; set "
                "data.document_mask=false", key="data.document_mask")

    def to_dict(self) -> dict:
        """The recipe as plain YAML-ready data (tuples become lists)."""
        return _plain(dataclasses.asdict(self))


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "parallel": ParallelConfig,
             "train": TrainConfig, "checkpoint": CheckpointConfig, "lora": LoraConfig}
"""The recipe's sections, in YAML order, and the dataclass each one becomes."""


def _check_module_names(key: str, names: tuple[str, ...]) -> None:
    for name in names:
        require(name != "" and name == name.strip() and " " not in name, key,
                f"holds {name!r}, which is not a module name; write names such as q_proj")
        require(names.count(name) == 1, key, f"names {name} twice")


def _check_seq_len(cfg: RecipeConfig) -> None:
    try:
        check_seq_len(cfg.data.seq_len, cfg.parallel.cp, cfg.parallel.layout,
                      what="data.seq_len", ranks="parallel.cp")
    except ValueError as exc:
        raise ConfigError(str(exc), key="data.seq_len") from None


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
