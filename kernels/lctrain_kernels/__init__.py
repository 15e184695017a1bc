"""lctrain_kernels: attention with log-sum-exp, DistFlashAttn, fused layer kernels.

``attention``, ``attention_with_lse``, ``dist_attention`` and ``dist_attention_with_lse`` are
:mod:`lctrain_kernels.api`'s, loaded with torch on first use; :mod:`lctrain_kernels.vocabulary`
holds the names, :mod:`lctrain_kernels.distributed` the sharding and schedules."""
import importlib

__all__ = ["attention", "attention_with_lse", "dist_attention", "dist_attention_with_lse"]


def __getattr__(name: str):
    """Load the attention API (and torch) on first use of one of its functions (PEP 562)."""
    if name in __all__:
        return getattr(importlib.import_module("lctrain_kernels.api"), name)
    raise AttributeError(f"module 'lctrain_kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
