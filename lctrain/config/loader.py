"""Recipe YAML -> :class:`RecipeConfig`, with ``--set`` overrides (YAML scalars: ``3e-4``,
``null``, ``[0.9, 0.99]``); and back to YAML. Unknown keys name the key, the file or ``--set``
and the closest known key; removed ones (:data:`REMOVED`) name their replacement."""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable

import yaml

from lctrain.config.hub import looks_like_hub_name
from lctrain.config.paths import (absolute_paths, check_model_path, decode_text, local_data,
                                  ordinary_permissions, read_recipe_text)
from lctrain.config.schema import SECTIONS as _SECTIONS, RecipeConfig
from lctrain.config.fields import parse_size, suggest
from lctrain.errors import ConfigError


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 scalars (``1e-4`` a float, only true/false booleans)."""


def _unique_keys(loader: _Yaml12Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A mapping whose keys must be unique (a repeated setting would win without a word)."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} appears twice (lines {seen[key]} and {line}); "
                "keep one", key_node.start_mark)
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Yaml12Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_keys)
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_FLOAT12 = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT12, list("-+0123456789"))


class _Yaml12Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper that also quotes strings `_Yaml12Loader` reads as floats ("1e5")."""


_Yaml12Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT12, list("-+0123456789"))

RESOLVED_HEADER = "# resolved lctrain recipe (all defaults and overrides applied)\n"
"""The first line of a run's saved config.yaml."""

_FREE_FORM = {("model", "config"), ("data", "fields")}
"""Fields whose value is a mapping: any key below them is accepted here (a transformers config;
data.fields checks its own)."""

_FUSED = ("use model.fused_kernels, one switch for lctrain's fused RMSNorm, RoPE, SwiGLU and "
          "loss kernels, the attention projections in head groups and the deferred norms (true "
          "by default)")
REMOVED = {
    **{f"model.{name}": _FUSED for name in ("fused_norms", "fused_rope", "fused_mlp", "fused_loss",
                                            "grouped_attention", "deferred_norms")},
    "parallel.dp": "the data-parallel degree is the world size / parallel.cp; drop it",
    "parallel.balance_documents": "packed documents are always balanced over the cp ranks; drop it",
    "train.layer_policies": "use train.checkpointing runs, e.g. full=4,remat=28",
    "train.state_offload": "use train.offload (optimizer, or state for parameters, gradients "
                           "and AdamW states)",
    "train.offload_prefetch": "parked layers always come back while the layer above runs its "
                              "backward; drop it",
    "train.planned": "lctrain estimate-memory --plan prints what it planned; drop it",
    "train.log_every": "every step is logged; drop it",
    "data.eval_seed": "train.seed chooses the held-out documents; drop it",
    "data.text_field": "use data.fields.text=NAME (data.fields maps our names to the records')",
    "data.split": "name the split in data.source, e.g. data.source=org/name[validation] (train "
                  "where none is named)",
    "data.eval_fraction": "use data.eval_source=SHARE, a number in (0, 1): the share of "
                          "data.source's documents held out",
    "data.cache_dir": "set the XDG_CACHE_HOME environment variable instead (the cache is "
                      "$XDG_CACHE_HOME/lctrain/data)",
    "checkpoint.enabled": "use checkpoint.keep=0 to save nothing",
    "checkpoint.on_signal": "a run that saves checkpoints always saves its last step when a "
                            "stop signal ends it; drop it",
    "checkpoint.asynchronous": "checkpoints are written in the background on GPUs and in the "
                               "foreground on CPUs; drop it"}
"""Recipe settings that are gone -> what replaces them (each refused in one sentence)."""

_FOREIGN = {
    "train.lr": "learning_rate lr",
    "train.epochs": "num_train_epochs num_epochs epochs",
    "train.batch_size": "per_device_train_batch_size micro_batch_size train_batch_size batch_size",
    "train.grad_accum": "gradient_accumulation_steps",
    "data.seq_len": "max_seq_length sequence_len max_seq_len max_length seq_length "
                    "model_max_length cutoff_len seq_len",
    "lora.rank": "lora_r r rank", "lora.alpha": "lora_alpha", "lora.dropout": "lora_dropout",
    "lora.target_modules": "lora_target_modules lora_target target_modules",
    "data.source": "dataset datasets dataset_name train_file data_path data_files",
    "model.path": "base_model model_name_or_path model_name model_path",
    "train.checkpointing": "gradient_checkpointing",
    "train.mixed_precision": "bf16 fp16 mixed_precision",
    "model.dtype": "torch_dtype dtype",
    "checkpoint.every": "save_steps", "checkpoint.keep": "save_total_limit",
    "train.eval_every": "eval_steps",
    "data.tokenizer": "tokenizer_name tokenizer tokenizer_name_or_path",
    "parallel.cp": "sequence_parallel_degree context_parallel_size cp",
    "train.betas": "adam_beta1 adam_beta2",
    "data.format": "formatting dataset_format",
    "data.eval_source": "val_set_size val_size eval_file validation_file",
    "data.fields": "dataset_text_field text_column columns tags field_messages "
                   "message_property_mappings message_field_role message_field_content "
                   "field_instruction field_input field_output",
    "data.turns": "mask_history train_on_last_turn",
    "data.chat_template": "chat_template template",
}
ALIASES = {**{f.name: f"{section}.{f.name}" for section, cls in _SECTIONS.items()
              for f in dataclasses.fields(cls)},
           **{name: key for key, names in _FOREIGN.items() for name in names.split()}}
"""A name people bring from Hugging Face's Trainer, axolotl, LLaMA-Factory or TRL, or a setting's
own name in another section (the last part of a key) -> the recipe key that means it: the "did
you mean" of an unknown key."""


def alias_hint(key: str) -> str:
    """``"; did you mean train.lr?"`` when the last part of ``key`` is a known foreign name of
    another setting, else ``""``."""
    target = ALIASES.get(key.rsplit(".", 1)[-1])
    return f"; did you mean {target}?" if target and target != key else ""


def _check_key(section: str, name: str, where: str) -> None:
    """Refuse a key the section lacks, naming ``where`` (``in FILE`` or ``--set ...``)."""
    key, known = f"{section}.{name}", [f.name for f in dataclasses.fields(_SECTIONS[section])]
    if key in REMOVED:
        raise ConfigError(f"{key} ({where}) is no longer a setting: {REMOVED[key]}", key=key)
    if name not in known:
        close = alias_hint(key) or suggest(key, [f"{section}.{k}" for k in known])
        raise ConfigError(f"unknown key {key} {where}{close} (known: {', '.join(known)})")


def load_recipe(path: str | os.PathLike | None = None, overrides: Iterable[str] = (),
                seq_len: int | str | None = None, output_dir: str | None = None,
                max_steps: int | None = None) -> RecipeConfig:
    """Read a recipe (a file, a shipped recipe's name, or None: the embedded default), apply
    ``overrides`` (``"a.b=c"``) and the ``seq_len`` / ``output_dir`` / ``max_steps`` flags, and
    return the checked, frozen config (ConfigError naming where a bad value came from)."""
    text, source = read_recipe_text(path)
    raw, origins = parse_yaml(text, source), {}
    if not isinstance(raw, dict):  # build_recipe says so, naming the file
        return build_checked(raw, source, origins)
    if text.startswith(RESOLVED_HEADER) and isinstance(raw.get("train"), dict):
        # a run's own config.yaml: the run is the folder holding it, wherever it was moved
        raw["train"]["output_dir"] = str(Path(source).expanduser().resolve().parent)
    for item in overrides:
        key, value = parse_override(item)
        set_key(raw, key, value, where=f"--set {item}")
        origins[key] = f"from --set {item}"
    flags = {"data.seq_len": None if seq_len is None else parse_size(seq_len, what="--seq-len"),
             "train.output_dir": output_dir, "train.max_steps": max_steps}
    for key, value in flags.items():
        flag = f"--{key.split('.')[1].replace('_', '-')}"
        if value is not None:
            set_key(raw, key, value, where=flag)
            origins[key] = f"from {flag} {value}"
    return build_checked(raw, source, origins)


def build_checked(raw: dict[str, Any], source: str, origins: dict[str, str]) -> RecipeConfig:
    """`build_recipe`, then the model path and data must exist; errors name where values came from."""
    try:
        cfg = build_recipe(raw, source)
        check_model_path(cfg.model.path)
        local_data(cfg.data.source)
        if isinstance(cfg.data.eval_source, str):
            local_data(cfg.data.eval_source, what="data.eval_source")
    except ConfigError as error:
        origin = _origin(error.key, origins, source)
        named = origin.split(" ", 1)[1] in str(error)  # the message already says where
        raise ConfigError(str(error) if named else f"{error} ({origin})", key=error.key) from None
    return absolute_paths(cfg)


def build_recipe(raw: dict[str, Any], source: str = "the recipe") -> RecipeConfig:
    """Build a RecipeConfig from plain data; unknown sections or keys name ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must be a mapping of sections (model, data, parallel, "
                          f"train, checkpoint), not a {type(raw).__name__}")
    for name in raw:
        if name not in _SECTIONS:
            hint = alias_hint(str(name)) or suggest(name, _SECTIONS)
            raise ConfigError(f"unknown section {name!r} in {source}{hint} "
                              f"(sections: {', '.join(_SECTIONS)})")
    if raw.get("model") is None:
        raise ConfigError(f"{source} has no model section; set model.path (a pretrained model) "
                          f"or model.config (a random init)")
    sections = {}
    for name, cls in _SECTIONS.items():
        values = raw.get(name) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"section {name} in {source} must be a mapping of settings, got "
                              f"{values!r}", key=name)
        for key in values:
            _check_key(name, key, f"in {source}")
        sections[name] = cls(**values)
    return RecipeConfig(**sections)


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``"a.b=c"`` into ``("a.b", value)`` with the value parsed as a YAML scalar."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r} must look like key=value, e.g. train.lr=1e-4")
    try:
        value = yaml.load(text, Loader=_Yaml12Loader) if text.strip() else None
    except yaml.YAMLError:
        quoted = text.strip().replace("'", "''")  # YAML's quotes, inside the shell's
        raise ConfigError(f"the value in --set {item!r} is not valid YAML; quote it for YAML "
                          f"inside the shell's quotes, e.g. --set \"{key}='{quoted}'\", or "
                          f"write it like train.betas=[0.9,0.95]") from None
    return key, value


def set_key(raw: dict[str, Any], key: str, value: Any, *, where: str) -> None:
    """Set the dotted ``key`` in the plain recipe data, refusing keys the schema lacks."""
    section, *rest = key.split(".")
    if section not in _SECTIONS:
        hint = suggest(section, _SECTIONS) or alias_hint(key)
        raise ConfigError(f"unknown key {key} in {where}{hint} (sections: {', '.join(_SECTIONS)})")
    if not rest:
        raise ConfigError(f"{where} names the whole section {section}; name one setting such "
                          f"as {section}.{dataclasses.fields(_SECTIONS[section])[0].name}")
    _check_key(section, rest[0], f"in {where}")
    if len(rest) > 1 and (section, rest[0]) not in _FREE_FORM:
        raise ConfigError(f"{section}.{rest[0]} is a single setting; write "
                          f"--set {section}.{rest[0]}=VALUE")
    node = raw
    for part in [section, *rest[:-1]]:  # a missing or non-mapping level becomes a mapping
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[rest[-1]] = value


def save_resolved(cfg: RecipeConfig, path: str | os.PathLike) -> Path:
    """Write the fully resolved recipe as YAML (atomically) and return the file's path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = RESOLVED_HEADER + yaml.dump(cfg.to_dict(), Dumper=_Yaml12Dumper, sort_keys=False,
                                      default_flow_style=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    ordinary_permissions(tmp)
    os.replace(tmp, path)
    return path


def read_resolved(path: str | os.PathLike) -> RecipeConfig:
    """A run's saved ``config.yaml`` as a RecipeConfig, paths unchecked (ConfigError)."""
    try:
        text = decode_text(Path(path).read_bytes(), str(path))
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise ConfigError(f"cannot read {path} ({reason})") from None
    return build_recipe(parse_yaml(text, str(path)), str(path))


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The YAML mapping of ``text``; an earlier run's config.yaml with today's keys (REMOVED's)."""
    try:
        raw = yaml.load(text, Loader=_Yaml12Loader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source} is not valid YAML{where}: "
                          f"{getattr(error, 'problem', None) or error}") from None
    data = raw.get("data") if text.startswith(RESOLVED_HEADER) and isinstance(raw, dict) else None
    if isinstance(data, dict):  # data.text_field, split, eval_fraction: fields, source, eval_source
        text_field, split = data.pop("text_field", "text"), data.pop("split", "train")
        if text_field != "text":
            data["fields"] = {**(data.get("fields") or {}), "text": text_field}
        name = str(data.get("source", "builtin"))
        if split != "train" and name != "builtin" and looks_like_hub_name(name):
            data["source"] = f"{name}[{split}]"
        if share := data.pop("eval_fraction", 0):
            data["eval_source"] = share
        held_out = data.get("eval_source")  # saved as given (relative) before it was absolute
        if isinstance(held_out, str) and glob.glob(os.path.expanduser(held_out), recursive=True):
            data["eval_source"] = os.path.abspath(os.path.expanduser(held_out))
    return {} if raw is None else raw


def _origin(key: str | None, origins: dict[str, str], source: str) -> str:
    """Where ``key`` (or the setting it lies below) was given: ``origins``' entry, else the file."""
    for given, origin in origins.items():
        if key is not None and (key == given or key.startswith((given + ".", given + "["))):
            return origin
    return f"in {source}"
