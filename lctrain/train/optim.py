"""AdamW with a linear warm-up and a cosine decay to a floor.

The learning rate of step s (counting optimizer steps from 0) is

    lr · (s + 1) / warmup                                  for s < warmup
    lr · (r + (1 − r) · ½ · (1 + cos(π · t)))             afterwards, t = (s − warmup) / (total − warmup)

where r = min_lr_ratio. Weight decay applies to matrices only (not to norms or biases).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lctrain.parallel.host_optim import HostAdamW


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """The learning-rate multiplier of step s, for `torch.optim.lr_scheduler.LambdaLR`.

    A plain function (a closure), so the scheduler's state_dict keeps only its position: a
    resumed run follows the schedule of ITS recipe (e.g. a larger max_steps), not the old one.
    """
    warmup, total, floor = max(0, warmup_steps), max(1, total_steps), min_lr_ratio

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    return multiplier


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    warmup_steps: int, total_steps: int, min_lr_ratio: float,
                    host_states: bool = False
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters plus its warm-up/cosine scheduler.

    Call this AFTER FSDP2 has been applied, so the optimizer holds the sharded parameters.
    ``host_states``: AdamW's states in pinned host memory (`lctrain.parallel.host_optim`).

    Returns:
        (optimizer, scheduler); step the scheduler once per optimizer step.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    adamw = HostAdamW if host_states else torch.optim.AdamW
    optimizer = adamw([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)
    schedule = warmup_cosine(warmup_steps, total_steps, min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return optimizer, scheduler
