"""The reference an export is checked against: the checkpoint's model run as lctrain trains it.

`training_logits` (called on every rank of a gloo group) rebuilds the run's model with lctrain's
attention, restores the checkpoint through DCP's own collective load (not the export's reader),
splits the sequence over the ranks as context parallelism does (global position ids, distflash,
reference backend) and gathers the logits. An export reloaded with plain transformers must give
the same logits.
"""
from __future__ import annotations

import torch


def training_logits(cfg, checkpoint, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, S, V) in float32 of the model in ``checkpoint`` on ``ids`` (B, S), with the
    sequence split over all ranks of the default group (every rank gets the whole result)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from lctrain.model import CPContext, load_model
    from lctrain.train.loop import CausalLMLoss
    from lctrain_kernels.distributed import shard, unshard

    model = load_model(cfg.model.path, config=cfg.model.config, seed=cfg.train.seed)
    if cfg.lora.enabled:
        from lctrain.model.lora import apply_lora

        model = apply_lora(model, cfg.lora, seed=cfg.train.seed)
    module = CausalLMLoss(model, cfg.train.loss_chunk_tokens)  # the trained module's names
    state = {"model": get_model_state_dict(module)}
    dcp.load(state, checkpoint_id=str(checkpoint))
    set_model_state_dict(module, state["model"])
    model.eval()
    group = dist.group.WORLD
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    ids_local = shard(ids, group=group, layout="contiguous", dim=1)  # (B, S/P)
    pos_local = shard(positions, group=group, layout="contiguous", dim=1)
    context = CPContext(group=group, cu_seqlens=None, schedule="distflash", backend="reference")
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids_local, position_ids=pos_local,
                                     use_cache=False, cp_context=context).last_hidden_state
        logits = model.get_output_embeddings()(hidden).float()  # (B, S/P, V)
    return unshard(logits.contiguous(), group=group, layout="contiguous", dim=1)
