"""LoRA through peft: low-rank adapters on chosen linear layers, every other weight frozen
(applied before checkpointing and FSDP2). B starts at zero, so training starts from the base
model; ``lora.trainable_modules`` are trained in full (peft's ``modules_to_save``). The output
head can be neither adapted nor trained: the chunked loss multiplies by its weight directly."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from lctrain.config.fields import suggest
from lctrain.config.schema import LORA_ALL_LINEAR, LoraConfig
from lctrain.errors import ConfigError
from lctrain.model.structure import decoder_layers

ADAPTER_NAME = "default"  # peft's name of the one adapter, in parameter names


def apply_lora(model: nn.Module, lora: LoraConfig, *, seed: int) -> nn.Module:
    """Wrap ``model`` (any device, also ``meta``) with LoRA adapters as ``lora`` says,
    initialised from ``seed`` without disturbing the global random state: the peft
    ``PeftModelForCausalLM`` around it (ConfigError: as `resolve_modules`)."""
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
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft's
        # adapters in the base weights' dtype, so an FSDP2 unit's trainable weights share one
        return peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME,
                                   autocast_adapter_dtype=False)


def resolve_modules(model: nn.Module, lora: LoraConfig) -> tuple[list[str], list[str]]:
    """Check the recipe's module names against ``model`` (a name matches a qualified name
    equal to it or ending in ``.name``) and resolve them for peft: (``target_modules``, the
    qualified names for ``modules_to_save``). ConfigError: a name matches no module, a target is
    not linear, the output head, or a trainable module that cannot be trained in full."""
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    linear = list(dict.fromkeys(q.rsplit(".", 1)[-1] for layer in decoder_layers(model)
                                for q, m in layer.named_modules() if isinstance(m, nn.Linear)))
    all_linear = tuple(lora.target_modules) == (LORA_ALL_LINEAR,)
    targets = linear if all_linear else list(lora.target_modules)
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
    nested = [(a, b) for a in trainable for b in trainable if b.startswith(a + ".")]
    if nested:
        raise ConfigError(f"lora.trainable_modules matches both {nested[0][0]} and {nested[0][1]} "
                          "inside it; name only one of them", key="lora.trainable_modules")
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


def _leaf_names(model: nn.Module) -> list[str]:
    """Distinct last name parts of the modules that hold parameters (not the output head)."""
    head = model.get_output_embeddings()
    return list(dict.fromkeys(q.rsplit(".", 1)[-1] for q, m in model.named_modules() if q
                              and m is not head and any(True for _ in m.parameters(False))))


def merge_adapter(adapter: str, base: str, out: Path, *, trust_remote_code: bool = False) -> Path:
    """Write ``base`` with the peft adapter in ``adapter`` merged into its weights (float32) as
    a model folder ``out``; return it. The merge is peft's, as a user loading the adapter gets."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(out)
    return out
