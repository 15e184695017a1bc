"""The model: load or build a causal LM, with lctrain's attention swapped in from outside.
The names below load on first use, so that `lctrain.model.families` (read by the memory model
and the command line) imports no torch."""
import importlib

_WHERE = {"CPContext": "attention", "register_attention": "attention",
          "check_model_config": "features", "check_model": "load", "load_model": "load",
          "load_tokenizer": "load", "resolve_config": "load"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"lctrain.model.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'lctrain.model' has no attribute {name!r}")
