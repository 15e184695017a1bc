"""One rank's model as training and evaluation run it: loaded, patched, adapted, checkpointed
and spread over the ranks (`build_model`), from what the rank is built from (`RunSetup`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from accelerate import Accelerator
from torch import nn

from lctrain.config import RecipeConfig
from lctrain.config.tiers import format_layer_policies, per_layer
from lctrain.model import load_model
from lctrain.model.flops import FlopModel
from lctrain.model.grouped_attention import apply_grouped_attention
from lctrain.model.lora import apply_lora
from lctrain.model.structure import decoder_layers
from lctrain.parallel.activation_checkpoint import apply_checkpointing
from lctrain.parallel.context import ContextParallel
from lctrain.parallel.fsdp import Distributed, distribute
from lctrain.parallel.mesh import ParallelMesh
from lctrain.parallel.tiling import apply_tiling


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What every part of one rank's run is built from.

    Attributes:
        cfg: the recipe, with ``parallel.dp`` resolved.
        pmesh: the dp × cp mesh and this rank's place in it.
        cp: how this rank holds and attends over its part of every sequence.
        accelerator: device, mixed precision, autocast and backward.
        stop: the stop-signal flag of this process (`lctrain.launch.stopping.StopRequest`;
            None where nothing stops early, as in an evaluation).
        control: the gloo group the ranks agree on it over (None: one rank).
    """

    cfg: RecipeConfig
    pmesh: ParallelMesh
    cp: ContextParallel
    accelerator: Accelerator
    stop: Any = None
    control: Any = None

    @property
    def main(self) -> bool:
        """Whether this is rank 0 (the one that prints and writes shared files)."""
        return self.pmesh.rank == 0

    @property
    def rows_per_step(self) -> int:
        """Packed rows one optimizer step takes over all ranks (the global batch)."""
        return self.pmesh.dp * self.cfg.train.batch_size * self.cfg.train.grad_accum


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """The model as the loop trains it.

    Attributes:
        model: the causal LM (inside ``distributed.module``).
        distributed: the `CausalLMLoss` around it, spread over the ranks.
        flops: its FLOP model (for MFU).
        n_params: its parameter count.
        layer_policies: the layers' checkpointing policies of an ``auto`` run (runs text).
    """

    model: nn.Module
    distributed: Distributed
    flops: FlopModel
    n_params: int
    layer_policies: str | None = None


def build_model(setup: RunSetup, root: Callable[[nn.Module, int, bool], nn.Module], *,
                layer_runs: tuple[tuple[str, int], ...] | None = None) -> ModelParts:
    """Model with the schedule's attention, checkpointing policy, then FSDP2 or replication.

    Args:
        setup: the rank's run.
        root: what wraps the causal LM as the module the ranks call, given the model,
            ``train.loss_chunk_tokens`` and whether the fused loss kernel may run (the training
            loss, or an evaluation's model).
        layer_runs: with ``train.checkpointing: auto``, the layers' policies as runs.
    """
    cfg, accelerator = setup.cfg, setup.accelerator
    model = load_model(cfg.model.path, config=cfg.model.config, seed=cfg.train.seed,
                       dtype=getattr(torch, cfg.model.dtype), device=accelerator.device,
                       attn_implementation=setup.cp.attention,
                       trust_remote_code=cfg.model.trust_remote_code,
                       seq_len=cfg.data.seq_len, cp=cfg.parallel.cp)
    n_params = sum(p.numel() for p in model.parameters())
    if accelerator.device.type == "cuda":  # Triton kernels, imported only where they run
        from lctrain.model.rms_norm import fuse_rms_norms
        from lctrain.model.rope import fuse_rope
        from lctrain.model.swiglu import fuse_mlps

        if cfg.model.fused_norms:  # one kernel per norm and direction instead of eager ops
            fuse_rms_norms(model)
        if cfg.model.fused_rope:  # the same for RoPE (its modeling module's global)
            fuse_rope(model.config.model_type)
        if cfg.model.fused_mlp:  # and for the MLP's SiLU product (its class, like the norms)
            fuse_mlps(model)
    if cfg.lora.enabled:  # LoRA adapters (peft), before checkpointing and FSDP2 wrap the layers
        model = apply_lora(model, cfg.lora, seed=cfg.train.seed)
    flops = _flop_model(model)
    setup.cp.check_model(model.config)
    if cfg.model.grouped_attention:  # projections in the head groups (after LoRA: none on it)
        apply_grouped_attention(model, cfg.parallel.head_groups, fused_rope=cfg.model.fused_rope,
                                defer_norm=cfg.model.deferred_norms)
    # the adapters inside the tiles
    apply_tiling(model, cfg.train.tile_tokens, defer_norm=cfg.model.deferred_norms)
    runs = layer_runs
    apply_checkpointing(model, cfg.train.checkpointing,  # before FSDP2 wraps the layers
                        layer_policies=per_layer(runs) if runs else None,
                        offload_prefetch=cfg.train.offload_prefetch)
    module = root(model, cfg.train.loss_chunk_tokens,
                  cfg.model.fused_loss and accelerator.device.type == "cuda")
    bf16 = accelerator.mixed_precision == "bf16"
    distributed = distribute(module, decoder_layers(model), world_mesh=setup.pmesh.world_mesh,
                             strategy=_strategy(setup),
                             param_dtype=torch.bfloat16 if bf16 else None,
                             offload=cfg.train.state_offload == "all")
    return ModelParts(model, distributed, flops, n_params,
                      format_layer_policies(runs) if runs else None)


def _flop_model(model: nn.Module) -> FlopModel:
    """The FLOP model of ``model`` as trained: its matrix parameters — all but input
    embeddings (lookups) and the frozen originals that peft keeps beside the trained copies of
    ``lora.trainable_modules`` (never run) — with the frozen ones (LoRA's base weights) apart."""
    head = model.get_output_embeddings().weight
    lookups = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False) if p is not head}
    matmul = [p for name, p in model.named_parameters()
              if id(p) not in lookups and ".original_module." not in name]
    frozen = sum(p.numel() for p in matmul if not p.requires_grad)
    return FlopModel.for_model(model.config, sum(p.numel() for p in matmul), frozen)


def _strategy(setup: RunSetup) -> str:
    """FSDP2 when asked ("on") or when the state lives on the host (its CPU offload), or by
    default on GPUs with several ranks; else replication."""
    fsdp, pmesh = setup.cfg.parallel.fsdp, setup.pmesh
    if fsdp == "on" or setup.cfg.train.state_offload == "all" or (
            fsdp == "auto" and pmesh.device_type == "cuda" and pmesh.world_size > 1):
        return "fsdp"
    return "replicate"
