"""Training: where the ranks run (launch), what each runs (runner: parts → loop), the loop, loss,
checkpoints and metrics.

    from lctrain.train import finetune
    exit_code = finetune(load_recipe("tiny"), resume=False, nproc=None)
"""
from lctrain.train.runner import finetune, run_worker

__all__ = ["finetune", "run_worker"]
