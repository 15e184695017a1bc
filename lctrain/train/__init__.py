"""Training: ``finetune(cfg, resume=False, nproc=None)`` starts every rank; ``run_worker`` is one.

The names load on first use, so that a started rank ties itself to its launcher before
anything heavy is imported (`lctrain.launch.lifetime`).
"""
from __future__ import annotations

__all__ = ["finetune", "run_worker"]


def __getattr__(name: str):
    if name in __all__:
        from lctrain.train import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
