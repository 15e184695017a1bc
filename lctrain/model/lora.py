"""LoRA through peft: low-rank adapters on chosen linear layers, every other weight frozen.

    model = apply_lora(model, cfg.lora, seed=cfg.train.seed)   # before checkpointing and FSDP2

`apply_lora` checks the recipe's module names against the model (one sentence for a name that
matches nothing, a module of the wrong kind, or the output head), builds a peft ``LoraConfig``
and wraps the model in peft's ``PeftModelForCausalLM``. What then trains:

- every targeted linear layer, ``y = W·x``, becomes ``y = W·x + B·A·dropout(x)·alpha/r`` with
  A (r × in, Kaiming-uniform) and B (out × r, zeros) trained and W frozen — so the first step
  starts from exactly the base model;
- every module named in ``lora.trainable_modules`` is trained in full as peft's
  ``modules_to_save``: peft keeps the original module (frozen) and trains a copy, so a checkpoint
  holds the base model and the trained copy both, and the adapter export carries the copy;
- everything else is frozen: no gradient, no optimizer state, no gradient reduce-scatter.

The rest of lctrain sees an ordinary module. Parameter names gain peft's parts
(``base_model.model.``, ``.base_layer``, ``.lora_A.default``, ``.original_module``,
``.modules_to_save.default``); the decoder layers stay where they were, of the same classes (so
`lctrain.parallel.activation_checkpoint.find_decoder_layers` and FSDP2 find them); the attention is
untouched (``remat`` still keeps its output and runs it once per layer); DCP checkpoints hold
every weight. The output head can be neither adapted nor wrapped: the chunked loss multiplies by
its weight directly, bypassing any module forward.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from lctrain.config.fields import suggest
from lctrain.config.schema import LORA_ALL_LINEAR, LoraConfig
from lctrain.errors import ConfigError
from lctrain.model.structure import decoder_layers

ADAPTER_NAME = "default"
"""peft's name of the one adapter lctrain trains (it appears in parameter names)."""


def apply_lora(model: nn.Module, lora: LoraConfig, *, seed: int) -> nn.Module:
    """Wrap ``model`` with LoRA adapters as ``lora`` says (in place; returns the peft model).

    The adapters are initialised from ``seed`` (the same on every rank, as FSDP2 needs) without
    disturbing the global random state.

    Args:
        model: a transformers causal LM (any device, also ``meta``).
        lora: the recipe's lora section, with ``rank > 0``.
        seed: seed of the adapters' initialisation.

    Returns:
        The peft ``PeftModelForCausalLM`` around ``model``.

    Raises:
        ConfigError: a module name that matches nothing, or a module that cannot be adapted or
            trained in full (see `resolve_modules`).
    """
    import peft

    targets, trainable = resolve_modules(model, lora)
    config = peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.scale_alpha, lora_dropout=lora.dropout,
        target_modules=targets, modules_to_save=trainable or None, bias="none",
        task_type="CAUSAL_LM")
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            warnings.catch_warnings():
        torch.manual_seed(seed)
        # peft asks transformers a deprecated question; the answer is right, the warning noise
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        # autocast_adapter_dtype=False: adapters take the base weights' dtype (float32 master
        # weights in lctrain's recipes), so all trainable weights of an FSDP2 unit share it
        return peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME,
                                   autocast_adapter_dtype=False)


def resolve_modules(model: nn.Module, lora: LoraConfig) -> tuple[list[str], list[str]]:
    """Check the recipe's module names against ``model`` and resolve them for peft.

    A module matches a name when its qualified name is the name or ends in ``.name``.

    Returns:
        (target names for peft's ``target_modules``: the recipe's names, or for ``all-linear``
        the distinct names of the decoder layers' linear layers; the qualified names of all
        modules matched by ``trainable_modules``, for peft's ``modules_to_save``).

    Raises:
        ConfigError: a name matches no module; a target is not a linear layer; either list
            reaches the output head; a trainable module holds an adapted layer or is a
            container; the embeddings are trained in full while tied to the output head.
    """
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    linear = _decoder_linear_names(model)
    if tuple(lora.target_modules) == (LORA_ALL_LINEAR,):
        targets = linear
    else:
        targets = list(lora.target_modules)
    adapted = set()
    for name in targets:
        for qualified, module in _matching(modules, name, "lora.target_modules", model, linear):
            _refuse_head(module, head, qualified, "lora.target_modules", name)
            if not isinstance(module, nn.Linear):
                raise ConfigError(
                    f"lora.target_modules names {name}, which matches {qualified}, a "
                    f"{type(module).__name__} and not a linear layer; adapt linear layers such "
                    f"as {', '.join(linear)}", key="lora.target_modules")
            adapted.add(qualified)
    trainable = []
    for name in lora.trainable_modules:
        for qualified, module in _matching(modules, name, "lora.trainable_modules", model,
                                           _leaf_names(model)):
            _check_trainable(model, module, head, qualified, name, adapted)
            trainable.append(qualified)
    for a in trainable:
        inner = [b for b in trainable if b.startswith(a + ".")]
        if inner:
            raise ConfigError(f"lora.trainable_modules matches both {a} and {inner[0]} inside it; "
                              "name only one of them", key="lora.trainable_modules")
    return targets, trainable


def _matching(modules: dict[str, nn.Module], name: str, key: str, model: nn.Module,
              known: list[str]) -> list[tuple[str, nn.Module]]:
    found = [(q, m) for q, m in modules.items() if q == name or q.endswith("." + name)]
    if not found:
        raise ConfigError(
            f"{key} names {name}, which matches no module of {type(model).__name__}"
            f"{suggest(name, known)} (names to choose from: {', '.join(known)})", key=key)
    return found


def _refuse_head(module: nn.Module, head: nn.Module, qualified: str, key: str, name: str) -> None:
    if module is head:
        raise ConfigError(
            f"{key} names {name}, which matches the output head {qualified}; lctrain's chunked "
            "loss multiplies by the head's weight directly, so the head can be neither adapted "
            "nor trained beside LoRA; leave it out (or train every weight, lora.rank 0)", key=key)


def _check_trainable(model: nn.Module, module: nn.Module, head: nn.Module, qualified: str,
                     name: str, adapted: set[str]) -> None:
    key = "lora.trainable_modules"
    _refuse_head(module, head, qualified, key, name)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        raise ConfigError(f"{key} names {name}, which matches {qualified}, a list of modules; "
                          "name the modules inside it (e.g. input_layernorm)", key=key)
    inside = sorted(a for a in adapted if a.startswith(qualified + "."))
    if inside:
        raise ConfigError(f"{key} names {name}, which matches {qualified}, a module holding the "
                          f"adapted layer {inside[0]}; a module is either adapted or fully "
                          "trained, so name smaller modules", key=key)
    embed = model.get_input_embeddings()
    if module is embed and head is not None and embed.weight is head.weight:
        raise ConfigError(
            f"{key} names {name}, the input embeddings, which this model ties to the output "
            "head; trained in full beside LoRA they would part from the head, so leave them out",
            key=key)


def _decoder_linear_names(model: nn.Module) -> list[str]:
    """Distinct names of the linear layers inside the decoder layers, in first-seen order."""
    names: list[str] = []
    for layer in decoder_layers(model):
        for qualified, module in layer.named_modules():
            leaf = qualified.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and leaf not in names:
                names.append(leaf)
    return names


def _leaf_names(model: nn.Module) -> list[str]:
    """Distinct last parts of the names of modules that hold parameters themselves (not the
    output head)."""
    head, names = model.get_output_embeddings(), []
    for qualified, module in model.named_modules():
        leaf = qualified.rsplit(".", 1)[-1]
        own = any(True for _ in module.parameters(recurse=False))
        if qualified and own and module is not head and leaf not in names:
            names.append(leaf)
    return names
