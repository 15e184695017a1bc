"""The training loop: each step normalises this rank's summed losses by the global label-token
count, sums gradients over ranks, clips and steps (a non-finite step skipped on the device):
the gradient of the mean token loss over the global batch, whatever dp, cp and batch."""
from __future__ import annotations

import contextlib
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
from lctrain.model.flops import FlopModel
from lctrain.model.fused import fused_cross_entropy
from lctrain.model.structure import head_inputs
from lctrain.parallel.activation_checkpoint import AttentionCounter
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.fsdp import Distributed
from lctrain.parallel.mesh import ParallelMesh, allocator_figures, peak_memory_bytes
from lctrain_kernels.api import chunked_cross_entropy
from lctrain.train.memory_trace import trace_folder, traced_step
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
    """The default of the hooks that only watch or tell."""


class CausalLMLoss(nn.Module):
    """The module the loop calls: decoder → final hidden states → summed token loss."""

    def __init__(self, model: nn.Module, chunk_tokens: int, fused: bool = False) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.fused = fused  # Liger's fused linear cross-entropy (CUDA)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
                cp_context: CPContext | None = None) -> torch.Tensor:
        """Summed float32 cross-entropy of this rank's shard (labels shifted before sharding)."""
        hidden, weight = head_inputs(self.model, input_ids=input_ids, position_ids=position_ids,
                                     cp_context=cp_context)  # (B, S_local, H), (V, H)
        if self.fused:
            return fused_cross_entropy(hidden, weight, labels)
        return chunked_cross_entropy(hidden, weight, labels, self.chunk_tokens)


@dataclass
class Trainer:
    """Everything one rank needs to run optimizer steps (accelerate: one accumulation step)."""

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
    step_trained: bool = True  # the last settled step's update was applied (not skipped)

    def __post_init__(self) -> None:
        self.nonfinite = NonFiniteSteps(self.device)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def train_step(self, micro: list[PackedBatch]) -> dict[str, Any]:
        """One optimizer step over this dp rank's global ``micro``-batches (device tensors, no sync)."""
        stats = self.accumulate_gradients(micro)
        stats.update(self.apply_gradients())
        self.data_position += len(micro)
        return stats

    def accumulate_gradients(self, micro: list[PackedBatch]) -> dict[str, torch.Tensor]:
        """Forward and backward of each micro-batch's summed loss ÷ the global label-token count."""
        cut = [(self.cp.shard(b), self.cp.work_balance) for b in micro]  # each with its balance
        shards = [s for s, _ in cut]
        self.work_balance = max((w for _, w in cut if w is not None), default=None)
        count = torch.stack([s.label_tokens() for s in shards]).sum().float()
        self.mark("count", self.step + 1)
        if self.pmesh.world_group is not None:
            dist.all_reduce(count, group=self.pmesh.world_group)  # global label tokens
        normaliser = count.clamp(min=1.0)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        self.mark("compute", self.step + 1)
        for s in shards:
            with self.accelerator.autocast():
                loss = self.distributed.module(s.input_ids, s.labels, s.position_ids,
                                               cp_context=self.cp.context(s))
            # a non-finite loss makes NaN gradients, so the global norm flags the step
            self.accelerator.backward(poison_if_nonfinite(loss) / normaliser)
            loss_sum += loss.detach()
        return {"loss_sum": loss_sum, "count": count}

    def apply_gradients(self) -> dict[str, Any]:
        """Sum over ranks, clip, step (a non-finite step is skipped on the device), clear."""
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
        """Read the skipped-step counters and wind the schedule back for the skipped steps."""
        if fetched is None:
            fetched = self.nonfinite.counters().tolist()
        settled = self.nonfinite.settle(fetched, self.scheduler)
        self.step_trained = settled.run == 0
        return settled

    def weights_finite(self) -> bool:
        """Whether every parameter of every rank is finite (a collective, one host transfer)."""
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in self.distributed.module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            bad += (~torch.isfinite(local.detach())).sum()
        if self.pmesh.world_group is not None:
            dist.all_reduce(bad, group=self.pmesh.world_group)
        return bad.item() == 0

    def reduce_for_log(self, stats: dict[str, Any], attn_units: int
                       ) -> tuple[float, float, float, tuple[int, int, int, float], Settled]:
        """(mean loss, gradient norm, attention units, (peak memory, peak reserved, allocator
        retries, attention balance or 0), skipped steps) in one all-reduce; the figures in the
        inner tuple are the most of any rank (the balance: of any dp rank's rows)."""
        world, rank = self.pmesh.world_size, self.pmesh.rank
        slots = [0.0] * (4 * world)  # a slot per figure and rank: the SUM is a gather
        figures = (peak_memory_bytes(self.device), *allocator_figures(self.device),
                   self.work_balance or 0.0)
        for i, figure in enumerate(figures):
            slots[i * world + rank] = float(figure)
        local = torch.cat([stats["loss_sum"].double().reshape(1),
                           torch.tensor([float(attn_units), *slots], dtype=torch.float64,
                                        device=self.device)])
        if self.pmesh.world_group is not None:
            dist.all_reduce(local, group=self.pmesh.world_group)
        already_global = torch.cat([torch.stack([stats["count"], stats["grad_norm"].float()]),
                                    self.nonfinite.counters()]).double()
        values = torch.cat([local, already_global]).tolist()
        loss_sum, units, count, norm = values[0], values[1], values[-5], values[-4]
        *memory, balance = (max(values[2 + i * world:2 + (i + 1) * world]) for i in range(4))
        settled = self.settle(values[-3:])
        units /= self.pmesh.cp  # the cp ranks of a sequence share its attention
        return loss_sum / max(count, 1.0), norm, units, (*map(int, memory), balance), settled


def attention_units(micro: list[PackedBatch]) -> int:
    """Causal attention work of global micro-batches: rows × Σ over documents of length²."""
    total = 0
    for batch in micro:
        rows, seq = batch.input_ids.shape
        bounds = batch.cu_seqlens or (0, seq)
        total += rows * sum((b - a) ** 2 for a, b in zip(bounds[:-1], bounds[1:]))
    return total


@dataclass
class LoopHooks:
    """What happens around the steps: log, progress, save (None: never), the agreed stop, notices,
    the watchdog's marks, validation every ``eval_every`` steps; ``stopped_by``: the signal."""

    max_steps: int
    checkpoint_every: int
    tokens_per_step: int
    flops: FlopModel
    peak_flops: float | None
    log: Callable[[dict], None]
    progress: Callable[[int, dict | None], None]
    save: Callable[[], Path] | None
    stop: Callable[[], int] = lambda: 0
    max_nonfinite_steps: int | None = None
    notice: Callable[[str], None] = _nothing
    mark: Callable[[str, int], None] = _nothing
    completed: Callable[[int], None] = _nothing
    history: list[dict] = field(default_factory=list)
    stopped_by: int = 0
    evaluate: Callable[[], float] | None = None
    eval_every: int = 0


def run_loop(trainer: Trainer, batches: Iterator[PackedBatch], hooks: LoopHooks) -> list[dict]:
    """Run steps from ``trainer.step`` to ``hooks.max_steps`` or a stop signal, logging each and
    saving every ``checkpoint_every`` (0: at the end), after the last and at a stop; returns the
    records (identical on every rank). Diverged: too many non-finite steps in a row."""
    first_step, saved, start, saving = trainer.step, trainer.step, time.perf_counter(), 0.0
    trace = trace_folder()  # lctrain bench step --memory-trace: the last step's allocations
    profile = profile_folder()  # lctrain bench step --profile: the last step's kernels
    while trainer.step < hooks.max_steps:
        hooks.mark("stop", trainer.step + 1)
        hooks.stopped_by = hooks.stop()
        if hooks.stopped_by:
            break
        micro = list(islice(batches, trainer.grad_accum))
        last, counting = trainer.step + 1 == hooks.max_steps, trainer.step == first_step
        where = (trainer.device, trainer.pmesh.rank, trainer.step + 1)
        with traced_step(trace if last else None, *where, trainer.distributed.module,
                         trainer.optimizer) as traced, \
                profiled_step(profile if last else None, *where) as profiled, \
                AttentionCounter() if counting else contextlib.nullcontext() as counter:
            stats = trainer.train_step(micro)  # counted once: remat runs attention once a layer
        start += traced["outside_s"] + profiled["outside_s"]  # their own work is not the step's
        calls = counter.total if counting else None
        step = trainer.step
        validate = hooks.evaluate is not None and (step == hooks.max_steps or (
            hooks.eval_every and step % hooks.eval_every == 0))
        record = _log(trainer, hooks, stats, attention_units(micro), start, saving, calls,
                      validate)
        start, saving = time.perf_counter(), 0.0
        hooks.progress(step, record)
        hooks.completed(step)
        if hooks.save is not None and (step == hooks.max_steps or (
                hooks.checkpoint_every and step % hooks.checkpoint_every == 0)):
            held = time.perf_counter()
            saved = _save(trainer, hooks)
            start = time.perf_counter()
            saving = start - held
    if hooks.stopped_by and hooks.save is not None and saved != trainer.step:
        _save(trainer, hooks)
    return hooks.history


def _log(trainer: Trainer, hooks: LoopHooks, stats: dict, attn_units: int, start: float,
         saving: float, calls: int | None, validate: bool) -> dict:
    """Reduce, record and write a step's figures (``saving``: seconds waited for a save)."""
    hooks.mark("log", trainer.step)
    loss, grad_norm, units, figures, settled = trainer.reduce_for_log(stats, attn_units)
    peak, reserved, retries, balance = figures
    elapsed = time.perf_counter() - start
    mfu = None
    if hooks.peak_flops and elapsed > 0:
        flops = hooks.flops.total(hooks.tokens_per_step, units)
        mfu = flops / elapsed / trainer.pmesh.world_size / hooks.peak_flops
    record = {"step": trainer.step, "loss": loss, "tokens": hooks.tokens_per_step,
              "tokens_per_s": hooks.tokens_per_step / elapsed if elapsed > 0 else float("nan"),
              "step_time_s": elapsed, "lr": stats["lr"], "grad_norm": grad_norm,
              "peak_memory_bytes": peak, "mfu": mfu, "time": time.time()}  # peak: any rank's most
    if trainer.device.type == "cuda":  # so far in the run, on the rank with the most
        record["peak_reserved_bytes"], record["alloc_retries"] = reserved, retries
    if calls is not None:
        record["attention_forward_calls"] = calls
    if balance:  # the busiest cp rank's attention work over the mean, of any dp rank's rows
        record["attention_balance"] = balance
    if saving:
        record["checkpoint_s"] = saving
    if validate:
        hooks.mark("eval", trainer.step)
        started = time.perf_counter()
        record.update(eval_loss=hooks.evaluate(), eval_time_s=time.perf_counter() - started)
    if settled.new:
        record["skipped_steps"] = settled.new
    hooks.history.append(record)
    hooks.log(record)
    _check_settled(trainer, hooks, settled)
    return record


def _save(trainer: Trainer, hooks: LoopHooks) -> int:
    """Settle the skipped steps, then save a checkpoint; returns the step saved."""
    hooks.mark("save", trainer.step)
    _check_settled(trainer, hooks, trainer.settle())
    hooks.save()
    return trainer.step


def _check_settled(trainer: Trainer, hooks: LoopHooks, settled: Settled) -> None:
    """Say which step was skipped; raise `Diverged` at ``max_nonfinite_steps`` in a row."""
    limit = hooks.max_nonfinite_steps
    if settled.new:
        hooks.notice(f"step {trainer.step}: {settled.new} step(s) with a non-finite loss or "
                     "gradient norm; their updates were skipped (weights, optimizer and "
                     f"learning-rate schedule unchanged), {settled.run} in a row now"
                     + (f" (the run stops at {limit})" if limit else ""))
    if limit and settled.longest >= limit:
        raise Diverged(trainer.step, settled.longest, limit)
