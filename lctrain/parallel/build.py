"""One rank's model as training and evaluation run it: loaded, patched, adapted, checkpointed
and spread over the ranks (`build_model`), from what the rank is built from (`RunSetup`)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from accelerate import Accelerator
from torch import nn

from lctrain.config import LayerPlan, RecipeConfig
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
    """What one rank's run is built from (``stop`` and ``control``: None where nothing stops)."""

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
    """The model as the loop trains it, and how its layers are kept (``auto`` placed)."""

    model: nn.Module
    distributed: Distributed
    flops: FlopModel
    n_params: int
    layers: LayerPlan = LayerPlan()


def build_model(setup: RunSetup, root: Callable[[nn.Module, int, bool], nn.Module], *,
                layers: LayerPlan | None = None) -> ModelParts:
    """The model with attention, LoRA, tiles, checkpointing (``layers``: the plan, ``auto``
    placed) under ``root``, then FSDP2 or replication."""
    cfg, accelerator = setup.cfg, setup.accelerator
    model = load_model(cfg.model.path, config=cfg.model.config, seed=cfg.train.seed,
                       dtype=getattr(torch, cfg.model.dtype), device=accelerator.device,
                       attn_implementation=setup.cp.attention,
                       trust_remote_code=cfg.model.trust_remote_code,
                       seq_len=cfg.data.seq_len, cp=cfg.parallel.cp)
    n_params = sum(p.numel() for p in model.parameters())
    fused = cfg.model.fused_kernels
    if fused and accelerator.device.type == "cuda":  # Liger's kernels, imported where they run
        from lctrain.model.fused import fuse_model

        fuse_model(model)
    if cfg.lora.enabled:  # LoRA adapters (peft), before checkpointing and FSDP2 wrap the layers
        model = apply_lora(model, cfg.lora, seed=cfg.train.seed)
    flops = _flop_model(model)
    setup.cp.check_model(model.config)
    if fused:  # projections in the head groups (after LoRA: none on it)
        apply_grouped_attention(model, cfg.parallel.head_groups, fused_rope=True, defer_norm=True)
    apply_tiling(model, cfg.train.tile_tokens, defer_norm=fused)  # the adapters inside the tiles
    layers = layers or cfg.train.layers
    apply_checkpointing(model, layers)  # before FSDP2 wraps the layers
    module = root(model, cfg.train.loss_chunk_tokens, fused and accelerator.device.type == "cuda")
    bf16, fsdp, pmesh = accelerator.mixed_precision == "bf16", cfg.parallel.fsdp, setup.pmesh
    # FSDP2 when asked, for state on the host, or on several GPUs; else replication
    sharded = fsdp == "on" or layers.state == "state" or (
        fsdp == "auto" and pmesh.device_type == "cuda" and pmesh.world_size > 1)
    distributed = distribute(module, decoder_layers(model), world_mesh=pmesh.world_mesh,
                             strategy="fsdp" if sharded else "replicate",
                             param_dtype=torch.bfloat16 if bf16 else None,
                             offload=layers.state == "state")
    return ModelParts(model, distributed, flops, n_params, layers)


def _flop_model(model: nn.Module) -> FlopModel:
    """The FLOP model of ``model`` as trained (peft's frozen originals left out)."""
    head = model.get_output_embeddings().weight
    lookups = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
               for p in m.parameters(recurse=False) if p is not head}
    matmul = [p for name, p in model.named_parameters()
              if id(p) not in lookups and ".original_module." not in name]
    frozen = sum(p.numel() for p in matmul if not p.requires_grad)
    return FlopModel.for_model(model.config, sum(p.numel() for p in matmul), frozen)
