"""Steps whose loss or gradient norm is not finite: skipped on the device (fused AdamW's
``found_inf``; the global norm decides, so every rank skips the same steps without a host sync),
the schedule wound back at the next sync; a streak of ``train.max_nonfinite_steps`` stops the run."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def poison_if_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times 1 when finite (bit-identical), times NaN otherwise, so that its gradients
    and the global gradient norm are NaN too."""
    finite = torch.isfinite(loss)
    scale = torch.where(finite, torch.ones_like(loss), torch.full_like(loss, float("nan")))
    return loss * scale


class Diverged(Exception):
    """``run`` steps in a row up to ``step`` were not finite (at least ``limit``)."""

    def __init__(self, step: int, run: int, limit: int) -> None:
        super().__init__(f"{run} steps in a row up to step {step} had a non-finite loss or "
                         f"gradient norm (train.max_nonfinite_steps is {limit})")


@dataclass(frozen=True)
class Settled:
    """At a sync: steps skipped since the previous one, the current streak, the longest one."""

    new: int
    run: int
    longest: int


class NonFiniteSteps:
    """The device counters of skipped steps and the host's view of them (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.skipped, self.run, self.longest = zero, zero.clone(), zero.clone()
        self._seen = 0  # skipped steps the schedule has been wound back for

    def count(self, bad: torch.Tensor) -> None:
        """Add one step whose flag is ``bad`` (a 0-d bool device tensor); no host sync."""
        flag = bad.float()
        self.skipped = self.skipped + flag
        self.run = (self.run + 1.0) * flag  # +1 on a bad step, 0 on a good one
        self.longest = torch.maximum(self.longest, self.run)

    def counters(self) -> torch.Tensor:
        """(skipped, run, longest) as one float32 device tensor, to fetch with other values."""
        return torch.stack([self.skipped, self.run, self.longest])

    def settle(self, values: list[float], scheduler) -> Settled:
        """Take the fetched `counters` and wind ``scheduler`` back for the new skipped steps."""
        skipped, run, longest = (int(v) for v in values)
        new, self._seen = skipped - self._seen, skipped
        if new:
            scheduler.last_epoch -= new + 1  # step() adds one back and recomputes the rates
            scheduler.step()
        self.longest = self.run.clone()  # a streak that goes on counts in the next window
        return Settled(new, run, longest)
