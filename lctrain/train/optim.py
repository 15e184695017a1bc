"""AdamW (torch's fused one, which skips a non-finite step on the device) with a linear warm-up
and a cosine decay to ``min_lr_ratio``; a resumed run of another length decays on from the
rate reached (`LrPlan.resumed`). Weight decay applies to matrices only."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from lctrain.parallel.host_optim import HostAdamW


@dataclass(frozen=True)
class LrPlan:
    """The learning-rate multiplier of every step; a resumed run decays from ``anchor_value``."""

    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    anchor_step: int | None = None
    """Where a re-planned decay starts (None: the plain warm-up/cosine)."""
    anchor_value: float | None = None
    """The multiplier at ``anchor_step``, from which the re-planned decay falls."""

    def __call__(self, step: int) -> float:
        warmup, floor = max(0, self.warmup_steps), self.min_lr_ratio
        if self.anchor_step is not None and step >= self.anchor_step:
            start, top = self.anchor_step, self.anchor_value
        elif step < warmup:
            return (step + 1) / warmup
        else:
            start, top = warmup, 1.0
        t = min(1.0, (step - start) / max(1, self.total_steps - start))
        return floor + (top - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    def resumed(self, step: int, total_steps: int) -> LrPlan:
        """The plan of a run that resumes at ``step`` and now ends at ``total_steps``."""
        if total_steps == self.total_steps:
            return self
        if step < self.warmup_steps and self.anchor_step is None:  # the warm-up is unchanged
            return dataclasses.replace(self, total_steps=total_steps)
        return dataclasses.replace(self, total_steps=total_steps, anchor_step=step,
                                   anchor_value=self(step))

    def to_json(self) -> dict:
        """The plan as JSON data (a checkpoint's trainer.json keeps it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LrPlan:
        """The plan `to_json` wrote (ValueError: not such a plan)."""
        try:
            plan = cls(**data)
        except TypeError as error:
            raise ValueError(f"not a learning-rate plan: {error}") from None
        ints = (plan.warmup_steps, plan.total_steps)
        if not all(isinstance(v, int) for v in ints) or not isinstance(plan.min_lr_ratio, float):
            raise ValueError(f"not a learning-rate plan: {data}")
        return plan


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    warmup_steps: int, total_steps: int, min_lr_ratio: float,
                    start_step: int = 0, resumed: LrPlan | None = None,
                    host_states: bool = False
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (`HostAdamW` with ``host_states``) and its scheduler from ``start_step``, after FSDP2."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    optimizer = (HostAdamW(groups, lr=lr, betas=betas, eps=eps) if host_states else
                 torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True))
    plan = (LrPlan(warmup_steps, total_steps, min_lr_ratio) if resumed is None
            else resumed.resumed(start_step, total_steps))
    for group in optimizer.param_groups:  # LambdaLR's resume point needs each base rate
        group["initial_lr"] = lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, plan, last_epoch=start_step - 1)
    return optimizer, scheduler
