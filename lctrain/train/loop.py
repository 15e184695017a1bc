"""The training loop: one optimizer step over dp × cp ranks, logging and checkpoints.

Per optimizer step, on every rank:

1. take ``grad_accum`` micro-batches of this dp rank (global sequences, labels already shifted)
   and cut each along the sequence for this cp rank, in the schedule's layout
   (`lctrain.parallel.context.ContextParallel.shard`);
2. count the label tokens of all of them and all-reduce the count over all dp × cp ranks —
   the ONE normaliser of the loss (one collective per step, no host synchronisation);
3. for each micro-batch, inside the schedule's session: forward of the decoder with global
   position ids and this rank's `CPContext` (`ContextParallel.context`), summed token
   cross-entropy through the output head in chunks (`chunked_cross_entropy`), backward of
   ``loss_sum / global_count``;
4. make gradients the sum over ranks (FSDP2 did it in the backward; replication all-reduces
   now), clip the global norm, step the optimizer and the learning-rate schedule — unless the
   loss or the norm is not finite: then fused AdamW skips the whole update on the device
   (`lctrain.train.nonfinite`).

So the gradient is exactly that of the mean token loss over the global batch, whatever dp, cp,
batch size and accumulation. Only log steps synchronise with the host (one small all-reduce and
one transfer of loss, count, gradient norm and the skipped-step counters); checkpoint saves
settle the counters too. At every step boundary the ranks agree on whether a stop signal came
(`lctrain.launch.stopping`: one all-reduce of one integer on the host), and the main thread marks
where it is for the hang watchdog (`lctrain.launch.watchdog`: an attribute write).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from lctrain.data import PackedBatch
from lctrain.model import CPContext
from lctrain.model.structure import output_head
from lctrain.parallel.activation_checkpoint import AttentionCounter
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.fsdp import Distributed
from lctrain.parallel.mesh import ParallelMesh
from lctrain.train.loss import chunked_cross_entropy
from lctrain.train.memory_trace import trace_folder, traced_step
from lctrain.model.flops import FlopModel
from lctrain.parallel.mesh import peak_memory_bytes
from lctrain.train.nonfinite import Diverged, NonFiniteSteps, Settled, poison_if_nonfinite
from lctrain.train.step_profile import profile_folder, profiled_step

OPERATIONS = {
    "stop": "the stop-signal check (an all-reduce at the step boundary)",
    "count": "the label-token all-reduce",
    "compute": "the forward and backward (attention exchanges, parameter gathers, gradient "
               "reduce-scatters)",
    "sync": "the gradient all-reduce",
    "update": "the gradient-norm reduction and the optimizer step",
    "log": "the metrics all-reduce",
    "save": "the checkpoint save",
    "eval": "the validation loss (forward passes over the held-out rows and their all-reduce)",
}
"""What the main thread runs in each part of a step, as the hang watchdog names it."""


def _nothing(*args) -> None:
    """The default of the hooks that only watch or tell (nobody listens)."""


class CausalLMLoss(nn.Module):
    """The module the loop calls: decoder → final hidden states → summed token loss.

    Wrapping the causal LM keeps the output head inside THIS module's forward, so when this
    module is the FSDP2 root its parameters (embeddings, final norm, head) are unsharded for the
    loss as for the decoder, and no logits tensor of the whole shard is ever built.
    """

    def __init__(self, model: nn.Module, chunk_tokens: int, kernel: bool | None = None) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.kernel = kernel  # `chunked_cross_entropy`'s: None = the Triton kernel on CUDA

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                cp_context: CPContext | None = None) -> torch.Tensor:
        """Summed (not averaged) float32 cross-entropy of this rank's tokens.

        Args:
            input_ids, labels, position_ids: (B, S_local) this rank's shard; labels shifted
                before sharding (-100 = ignore); GLOBAL position ids.
            cp_context: how attention is distributed (None: local causal attention).
        """
        hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                          use_cache=False, cp_context=cp_context
                                          ).last_hidden_state  # (B, S_local, H)
        weight = output_head(self.model).weight  # (V, H)
        dtype = _compute_dtype(hidden, weight)
        return chunked_cross_entropy(hidden.to(dtype), weight.to(dtype), labels, self.chunk_tokens,
                                     kernel=self.kernel)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


@dataclass
class Trainer:
    """Everything one rank needs to run optimizer steps (built by `lctrain.train.runner`).

    accelerate runs each micro-batch: its forward under the accelerator's autocast (mixed
    precision) and its backward through `Accelerator.backward`. The accumulation over
    micro-batches and the loss normalisation stay here, because accelerate's own accumulation
    divides each micro-batch's loss by the number of micro-batches — a mean of per-micro-batch
    means — where the global label-token count is the one exact normaliser (module docstring);
    so the accelerator is made with one accumulation step and scales nothing.
    """

    distributed: Distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    pmesh: ParallelMesh
    cp: ContextParallel
    accelerator: Accelerator
    grad_accum: int
    max_grad_norm: float
    step: int = 0
    data_position: int = 0  # micro-batches consumed by this dp rank
    mark: Callable[[str, int], None] = _nothing  # (OPERATIONS key, step) for the watchdog
    work_balance: float | None = None  # the last step's busiest cp rank over the mean (documents)
    host_probe: Callable[[], int] | None = None  # host bytes held for training, read each step
    host_peak: int = 0  # the most host_probe read, after a backward (gradients still held)

    def __post_init__(self) -> None:
        self.nonfinite = NonFiniteSteps(self.device)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def train_step(self, micro: list[PackedBatch]) -> dict[str, Any]:
        """One optimizer step over ``micro`` (this dp rank's global micro-batches).

        Returns:
            Device tensors (no host sync): this rank's summed loss, the global label-token
            count and the global gradient norm before clipping; and the step's learning rate.
        """
        stats = self.accumulate_gradients(micro)
        stats.update(self.apply_gradients())
        self.data_position += len(micro)
        return stats

    def accumulate_gradients(self, micro: list[PackedBatch]) -> dict[str, torch.Tensor]:
        """Forward and backward of every micro-batch; gradients are NOT yet summed over ranks.

        Each micro-batch's summed token loss is divided by the global label-token count of the
        whole step: the one place where the loss is normalised.
        """
        shards, balances = [], []
        for b in micro:
            shards.append(self.cp.shard(b))
            balances.append(self.cp.work_balance)
        self.work_balance = max((w for w in balances if w is not None), default=None)
        count = torch.stack([s.label_tokens() for s in shards]).sum().float()
        self.mark("count", self.step + 1)
        if self.pmesh.world_group is not None:
            dist.all_reduce(count, group=self.pmesh.world_group)  # global label tokens
        normaliser = count.clamp(min=1.0)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.mark("compute", self.step + 1)
        for s in shards:
            with self.cp.session(s):
                with self.accelerator.autocast():
                    loss = self.distributed.module(s.input_ids, s.labels, s.position_ids,
                                                   cp_context=self.cp.context(s))
                # a non-finite loss makes NaN gradients, so the global norm flags the step
                self.accelerator.backward(poison_if_nonfinite(loss) / normaliser)
            loss_sum += loss.detach()
        return {"loss_sum": loss_sum, "count": count}

    def apply_gradients(self) -> dict[str, Any]:
        """Sum gradients over ranks, clip, step optimizer and schedule, clear gradients.

        A step whose global gradient norm is not finite (the same number on every rank) is
        skipped on the device: fused AdamW's ``found_inf`` leaves parameters, moments and step
        counts as they were (`lctrain.train.nonfinite`); no host synchronisation.
        """
        self.mark("sync", self.step + 1)
        self.distributed.sync_gradients()
        self.mark("update", self.step + 1)
        grad_norm = self.distributed.clip_grad_norm(self.max_grad_norm or None)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses (a host float)
        bad = ~torch.isfinite(grad_norm)
        self.optimizer.found_inf = bad.float()  # read by fused AdamW's step
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        self.scheduler.step()  # wound back at the next sync if the step was skipped
        if self.host_probe is not None:  # before the gradients go (on the host with offload)
            self.host_peak = max(self.host_peak, self.host_probe())
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.count(bad)
        self.step += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def settle(self, fetched: list[float] | None = None) -> Settled:
        """Read the skipped-step counters (one host transfer unless ``fetched`` already holds
        them) and wind the schedule back for the skipped steps."""
        if fetched is None:
            fetched = self.nonfinite.counters().tolist()
        return self.nonfinite.settle(fetched, self.scheduler)

    def weights_finite(self) -> bool:
        """Whether every parameter of every rank is finite (a collective, one host transfer)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in self.distributed.module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            bad += (~torch.isfinite(local.detach())).sum()
        if self.pmesh.world_group is not None:
            dist.all_reduce(bad, group=self.pmesh.world_group)
        return bad.item() == 0

    def reduce_for_log(self, stats: dict[str, Any],
                       attn_units: int) -> tuple[float, float, float, int, Settled]:
        """Global figures of a step: ONE all-reduce and ONE host transfer.

        Args:
            stats: what `train_step` returned.
            attn_units: this rank's causal attention work (Σ document length²) since the last
                log, counted on its global sequences.

        Returns:
            (mean token loss over all ranks, gradient norm, attention units of all dp groups,
            the largest peak memory of any rank in bytes, the skipped steps settled).
        """
        world = self.pmesh.world_size
        peaks = torch.zeros(world, dtype=torch.float64, device=self.device)  # one slot per rank:
        peaks[self.pmesh.rank] = float(peak_memory_bytes(self.device))    # the SUM is a gather
        local = torch.cat([stats["loss_sum"].double().reshape(1),
                           torch.tensor([float(attn_units)], dtype=torch.float64,
                                        device=self.device), peaks])
        if self.pmesh.world_group is not None:
            dist.all_reduce(local, group=self.pmesh.world_group)
        already_global = torch.cat([torch.stack([stats["count"], stats["grad_norm"].float()]),
                                    self.nonfinite.counters()]).double()
        values = torch.cat([local, already_global]).tolist()
        loss_sum, units, count, norm = values[0], values[1], values[-5], values[-4]
        peak = int(max(values[2:2 + world]))
        settled = self.settle(values[-3:])
        return (loss_sum / max(count, 1.0), norm, units / self.pmesh.cp, peak,  # cp ranks share
                settled)


def attention_units(micro: list[PackedBatch]) -> int:
    """Causal attention work of global micro-batches: rows × Σ over documents of length²."""
    total = 0
    for batch in micro:
        rows, seq = batch.input_ids.shape
        bounds = batch.cu_seqlens or (0, seq)
        total += rows * sum((b - a) ** 2 for a, b in zip(bounds[:-1], bounds[1:]))
    return total


def _no_stop() -> int:
    return 0


@dataclass
class LoopHooks:
    """What happens around the steps: logging, validation, checkpointing, stopping (see
    `run_loop`).

    Attributes:
        stop: the agreed stop signal of all ranks (0: go on); a collective, called by every
            rank at every step boundary (`lctrain.launch.stopping.StopRequest.agree`).
        save_on_stop: save a checkpoint when a stop signal ends the run.
        max_nonfinite_steps: non-finite steps in a row that end the run (`Diverged`).
        notice: says something to the user (rank 0 prints it; skipped steps).
        mark, completed: the watchdog's `enter` (operation, step) and `completed` (step).
        evaluate: the validation loss (a collective); None: no validation.
        eval_every: validate every N steps (0: only after the last).
        stopped_by: set by `run_loop`: the signal that stopped the run (0: none).
    """

    max_steps: int
    log_every: int
    checkpoint_every: int
    tokens_per_step: int
    flops: FlopModel
    peak_flops: float | None
    log: Callable[[dict], None]
    progress: Callable[[int, dict | None], None]
    save: Callable[[], Path] | None  # None: never save
    stop: Callable[[], int] = _no_stop
    save_on_stop: bool = False
    max_nonfinite_steps: int | None = None
    notice: Callable[[str], None] = _nothing
    mark: Callable[[str, int], None] = _nothing
    completed: Callable[[int], None] = _nothing
    history: list[dict] = field(default_factory=list)
    stopped_by: int = 0
    evaluate: Callable[[], float] | None = None  # validation loss (collective); None: none
    eval_every: int = 0  # validate every N steps (0: only after the last)


@dataclass
class _Window:
    """The steps since the last log (or save, which is not training time)."""

    start: float = field(default_factory=time.perf_counter)
    saving: float = 0.0  # seconds the loop was held by the save before this window
    steps: int = 0
    attn_units: int = 0
    attn_calls: int | None = None  # attention forwards counted in the run's first step
    balance: float | None = None  # the worst attention work balance of its steps
    stats: dict | None = None  # the last step's train_step figures


def run_loop(trainer: Trainer, batches: Iterator[PackedBatch], hooks: LoopHooks) -> list[dict]:
    """Run optimizer steps from ``trainer.step`` to ``hooks.max_steps``, or until a stop signal.

    Logs every ``log_every`` steps, at the last one and at a stop; with ``evaluate``, computes
    the validation loss every ``eval_every`` steps and after the last, into that step's record
    (a validation step is always logged; its time is not training time); saves a checkpoint
    every ``checkpoint_every`` steps (0: only at the end), always after the last step, and at a
    stop when ``save_on_stop``. Every checkpoint is of applied updates only: the skipped-step
    counters are settled first (`Trainer.settle`).

    Returns:
        The logged records (identical on every rank).

    Raises:
        Diverged: ``max_nonfinite_steps`` steps in a row had a non-finite loss or gradient norm.
    """
    window, first_step, saved = _Window(), trainer.step, trainer.step
    trace = trace_folder()  # lctrain bench step --memory-trace: the last step's allocations
    profile = profile_folder()  # lctrain bench step --profile: the last step's kernels
    while trainer.step < hooks.max_steps:
        hooks.mark("stop", trainer.step + 1)
        hooks.stopped_by = hooks.stop()
        if hooks.stopped_by:
            break
        micro = list(islice(batches, trainer.grad_accum))
        last = trainer.step + 1 == hooks.max_steps
        with traced_step(trace if last else None, trainer.device, trainer.pmesh.rank,
                         trainer.step + 1, trainer.distributed.module, trainer.optimizer), \
                profiled_step(profile if last else None, trainer.device, trainer.pmesh.rank,
                              trainer.step + 1):
            if trainer.step == first_step:  # count once: remat runs attention once per layer
                with AttentionCounter() as counter:
                    window.stats = trainer.train_step(micro)
                window.attn_calls = counter.total
            else:
                window.stats = trainer.train_step(micro)
        window.steps += 1
        window.attn_units += attention_units(micro)
        if trainer.work_balance is not None:
            window.balance = max(window.balance or 0.0, trainer.work_balance)
        step, record = trainer.step, None
        validate = hooks.evaluate is not None and (step == hooks.max_steps or (
            hooks.eval_every and step % hooks.eval_every == 0))
        if step % hooks.log_every == 0 or step == hooks.max_steps or validate:
            record, window = _log(trainer, hooks, window, validate=validate), _Window()
        hooks.progress(step, record)
        hooks.completed(step)
        if hooks.save is not None and (step == hooks.max_steps or (
                hooks.checkpoint_every and step % hooks.checkpoint_every == 0)):
            held = time.perf_counter()
            saved = _save(trainer, hooks)
            window = _Window(saving=time.perf_counter() - held)
    if hooks.stopped_by:
        if window.steps:
            hooks.progress(trainer.step, _log(trainer, hooks, window))
        if hooks.save is not None and hooks.save_on_stop and saved != trainer.step:
            _save(trainer, hooks)
    return hooks.history


def _log(trainer: Trainer, hooks: LoopHooks, window: _Window, *, validate: bool = False) -> dict:
    """Reduce, record and write the figures of the steps in ``window`` (a host sync), with the
    validation loss when ``validate``."""
    hooks.mark("log", trainer.step)
    loss, grad_norm, units, peak, settled = trainer.reduce_for_log(window.stats,
                                                                   window.attn_units)
    record = _record(trainer, hooks, window, loss, grad_norm, window.stats["lr"], units, peak)
    if validate:
        hooks.mark("eval", trainer.step)
        start = time.perf_counter()
        record.update(eval_loss=hooks.evaluate(), eval_time_s=time.perf_counter() - start)
    if settled.new:
        record["skipped_steps"] = settled.new
    hooks.history.append(record)
    hooks.log(record)
    _check_settled(trainer, hooks, settled, window.steps)
    return record


def _save(trainer: Trainer, hooks: LoopHooks) -> int:
    """Settle the skipped steps, then save a checkpoint; returns the step saved."""
    hooks.mark("save", trainer.step)
    _check_settled(trainer, hooks, trainer.settle(), 1)
    hooks.save()
    return trainer.step


def _check_settled(trainer: Trainer, hooks: LoopHooks, settled: Settled, window: int) -> None:
    """Say which steps were skipped; raise `Diverged` at ``max_nonfinite_steps`` in a row."""
    limit = hooks.max_nonfinite_steps
    if settled.new:
        where = (f"step {trainer.step}" if window == 1
                 else f"steps {trainer.step - window + 1}-{trainer.step}")
        hooks.notice(f"{where}: {settled.new} step(s) with a non-finite loss or gradient norm; "
                     "their updates were skipped (weights, optimizer and learning-rate schedule "
                     f"unchanged), {settled.run} in a row now"
                     + (f" (the run stops at {limit})" if limit else ""))
    if limit and settled.longest >= limit:
        raise Diverged(trainer.step, settled.longest, limit)


def _record(trainer: Trainer, hooks: LoopHooks, window: _Window, loss: float, grad_norm: float,
            lr: float, attn_units: float, peak_bytes: int) -> dict:
    elapsed = time.perf_counter() - window.start
    steps = max(window.steps, 1)
    tokens = hooks.tokens_per_step * window.steps
    tokens_per_s = tokens / elapsed if elapsed > 0 else float("nan")
    mfu = None
    if hooks.peak_flops and elapsed > 0:
        flops = hooks.flops.total(tokens, attn_units)
        mfu = flops / elapsed / trainer.pmesh.world_size / hooks.peak_flops
    record = {"step": trainer.step, "loss": loss, "tokens": hooks.tokens_per_step,
              "tokens_per_s": tokens_per_s, "step_time_s": elapsed / steps, "lr": lr,
              "grad_norm": grad_norm, "peak_memory_bytes": peak_bytes,  # max over ranks
              "mfu": mfu}
    if window.attn_calls is not None:
        record["attention_forward_calls"] = window.attn_calls
    if window.balance is not None:  # the busiest cp rank's attention work over the mean
        record["attention_balance"] = window.balance
    if window.saving:  # the loop waited this long for a save (its copy, or the one before)
        record["checkpoint_s"] = window.saving
    return record
