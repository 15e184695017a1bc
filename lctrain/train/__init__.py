"""Training: where the ranks run (launch), what each runs (runner: parts → loop), the loop, loss,
checkpoints and metrics.

    from lctrain.train import finetune
    exit_code = finetune(load_recipe("tiny"), resume=False, nproc=None)

The names below load on first use: the processes a run starts (``python -m lctrain.train``,
``python -m lctrain.launch.agent``) tie themselves to their launcher before anything heavy
is imported (`lctrain.launch.lifetime`).
"""
from __future__ import annotations

__all__ = ["finetune", "run_worker"]


def __getattr__(name: str):
    if name in __all__:
        from lctrain.train import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
