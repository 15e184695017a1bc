"""What rank 0 says before the first step (`banner`) and after the last (`summary`)."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from lctrain.config import RecipeConfig
from lctrain.config.schema import LORA_ALL_LINEAR
from lctrain.launch import launcher
from lctrain.launch.lifetime import signal_name
from lctrain.train.loop import Trainer
from lctrain.parallel.build import ModelParts, RunSetup


def banner(setup: RunSetup, parts: ModelParts, trainer: Trainer, rows: int) -> str:
    """The line rank 0 prints before the first step: model, data, ranks, steps."""
    cfg, pmesh = setup.cfg, setup.pmesh
    t = cfg.train
    used = trainer.data_position * pmesh.dp * t.batch_size
    start = (f", resuming at step {trainer.step} after {used} rows = {used * cfg.data.seq_len} "
             "tokens of the data stream" if trainer.step else "")
    line = (f"lctrain finetune: {parts.n_params / 1e6:.2f}M parameters, seq_len "
            f"{cfg.data.seq_len}, {rows} packed rows; {pmesh.world_size} x "
            f"{pmesh.device_type} (dp {pmesh.dp} x cp {pmesh.cp}, {cfg.parallel.schedule}, "
            f"{parts.distributed.strategy}); {t.max_steps} steps x "
            f"{pmesh.dp * t.batch_size * t.grad_accum} sequence(s){start}")
    extras = [_lora_line(cfg, parts.model)] if cfg.lora.enabled else []
    return line + "".join(f"\n  {extra}" for extra in extras + _memory_settings(cfg, parts))


def _lora_line(cfg: RecipeConfig, model: nn.Module) -> str:
    """The banner line of a LoRA run: settings, adapted layers, trainable parameters."""
    from peft.tuners.lora import LoraLayer

    lora = cfg.lora
    adapted = [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    kinds = ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in adapted))
    chosen = " (all-linear)" if tuple(lora.target_modules) == (LORA_ALL_LINEAR,) else ""
    full = (f"; trained in full: {', '.join(lora.trainable_modules)}"
            if lora.trainable_modules else "")
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    return (f"lora: rank {lora.rank}, alpha {lora.scale_alpha:g}, dropout {lora.dropout:g} on "
            f"{len(adapted)} linear layers: {kinds}{chosen}{full}; {trained:,} trainable of "
            f"{total:,} parameters ({100 * trained / max(total, 1):.3g} %)")


def _memory_settings(cfg: RecipeConfig, parts: ModelParts) -> list[str]:
    """Banner lines for the long-context settings, in the recipe's words (``auto`` as placed)."""
    layers = parts.layers
    placed = " (placed by the memory model)" if cfg.train.layers.auto else ""
    settings = [f"{k} {v}" for k, v in (("checkpointing", layers.checkpointing + placed),
                                         ("offload", layers.offload),
                                         ("tile_tokens", cfg.train.tile_tokens),
                                         ("head_groups", cfg.parallel.head_groups))
                if v not in (0, 1, "none")]
    return ["memory: " + ", ".join(settings)] if settings else []


def summary(setup: RunSetup, trainer: Trainer, history: list[dict], stopped_by: int) -> str:
    """The line rank 0 prints after the loop: done, nothing to do, or stopped by a signal."""
    t, out = setup.cfg.train, setup.cfg.train.output_dir
    if stopped_by:
        when = f"after step {trainer.step}" if history else f"before step {trainer.step + 1}"
        return (f"stopped by {signal_name(stopped_by)} {when} of {t.max_steps}; "
                f"{launcher.checkpoint_hint(setup.cfg, setup.pmesh.world_size)}")
    if not history:
        return (f"nothing to do: the run is already at step {trainer.step} of {t.max_steps}; "
                "raise train.max_steps (--max-steps) to train further.")
    saved = ("metrics, config and checkpoints" if setup.cfg.checkpoint.enabled
             else "metrics and config")
    first, last = history[0], history[-1]
    evaluated = (f", eval loss {last['eval_loss']:.4f}"
                 if isinstance(last.get("eval_loss"), float) else "")
    skipped = sum(record.get("skipped_steps", 0) for record in history)
    skips = (f"; {skipped} of the {len(history)} steps run had a non-finite loss or gradient "
             "norm and were skipped (their updates not applied)" if skipped else "")
    return (f"done: step {last['step']}/{t.max_steps}, loss {first['loss']:.4f} -> "
            f"{last['loss']:.4f}{evaluated}{skips}; {saved} in {Path(out)}")
