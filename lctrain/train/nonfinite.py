"""Steps whose loss or gradient norm is not finite: skipped on the device, reported at a sync.

A NaN or an infinity in one step (an overflow, a bad batch, a learning rate far too high) must
not reach the weights: AdamW would spread it into every parameter and both moment buffers, and
every later checkpoint would be garbage. Deciding on the host would cost a host synchronisation
every step, so the decision is made on the device and only read where the loop synchronises
anyway (log steps and checkpoint saves):

- the decision is the global gradient norm's finiteness. The norm is computed after the
  gradients are summed over all ranks, so it is the same number on every rank: every rank
  skips the same steps, with no collective added. A non-finite loss on any rank reaches it
  because the loop poisons that rank's gradients (`poison_if_nonfinite`);
- the skip is fused AdamW's own: given ``found_inf`` (the flag, a device tensor), its kernel
  leaves parameters, moments and step counts untouched — the mechanism torch's GradScaler uses.
  The gradients are dropped with every step's ``zero_grad``;
- the learning-rate schedule runs on the host and cannot see the flag, so it steps every time
  and is wound back by the number of skipped steps at the next sync (`NonFiniteSteps.settle`):
  with ``train.log_every`` 1 (the default) that is the same step, otherwise the steps in between
  use a rate that many steps ahead, and the saved schedule is always the exact one;
- three device counters (skipped in total, the current streak, the longest streak since the
  last sync) travel with the log's one host transfer; a streak of ``train.max_nonfinite_steps``
  stops the run (`Diverged`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def poison_if_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times 1 when finite, times NaN otherwise, so that its backward's gradients are NaN.

    A non-finite loss usually gives non-finite gradients anyway; this makes it certain, so the
    gradient norm (summed over ranks) carries every rank's loss check. Multiplying by 1 changes
    neither the loss nor its gradients by a bit.
    """
    finite = torch.isfinite(loss)
    scale = torch.where(finite, torch.ones_like(loss), torch.full_like(loss, float("nan")))
    return loss * scale


class Diverged(Exception):
    """``run`` steps in a row up to ``step`` were not finite (at least ``limit``)."""

    def __init__(self, step: int, run: int, limit: int) -> None:
        super().__init__(f"{run} steps in a row up to step {step} had a non-finite loss or "
                         f"gradient norm (train.max_nonfinite_steps is {limit})")
        self.step, self.run, self.limit = step, run, limit


@dataclass(frozen=True)
class Settled:
    """What the device counters said at a sync.

    Attributes:
        new: steps skipped since the previous sync.
        run: the current streak of non-finite steps.
        longest: the longest streak since the previous sync.
    """

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
