"""The model as an evaluation calls it, and a training checkpoint's weights put into it.

`EvalModel` plays the part `lctrain.train.loop.CausalLMLoss` plays in training: the one module
whose forward an evaluation calls, so that as the FSDP2 root it gathers the embeddings, the
final norm and the output head for the whole forward. It is built by the training's own
`lctrain.train.runner.build_model` (same loading, LoRA, FSDP2 or replication), holds the causal
LM under the same attribute name (``model``), and so has the very parameter names of the
training module: a DCP checkpoint of any run loads into it (`load_weights`), whatever the
number of ranks that wrote it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lctrain.errors import UserError
from lctrain.parallel.forward import bucket_sums
from lctrain.model import CPContext
from lctrain.model.structure import output_head


class EvalModel(nn.Module):
    """decoder → final hidden states → per-position loss sums, or next-token logits.

    Args:
        model: the causal LM (built with the ``lctrain_eval`` attention).
        chunk_tokens: tokens whose logits are held at once (``train.loss_chunk_tokens``).
    """

    def __init__(self, model: nn.Module, chunk_tokens: int, kernel: bool = False) -> None:
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *,
                cp_context: CPContext | None = None, labels: torch.Tensor | None = None,
                width: int = 1, buckets: int = 1, kv=None, at: int | None = None
                ) -> torch.Tensor:
        """Loss sums per position bucket (with ``labels``), or the logits that follow the
        token at global position ``at``.

        Args:
            input_ids, position_ids: (B, S_local) this rank's shard; GLOBAL position ids.
            cp_context: how attention is distributed (None: local).
            labels: (B, S_local) shifted labels (-100 = none): return bucket sums.
            width, buckets: the position buckets (see `lctrain.parallel.forward.bucket_sums`).
            kv: a `lctrain.eval.decode.KVShards` that keeps (prefill) or uses (decoding)
                this rank's keys and values.
            at: without labels, the global position whose next-token logits to return.

        Returns:
            (2, buckets) float64 sums and counts; or (B, V) float32 logits, zeros on a rank
            that does not hold position ``at``.
        """
        extra = {} if kv is None else {"lctrain_kv": kv}
        hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                          use_cache=False, cp_context=cp_context, **extra
                                          ).last_hidden_state  # (B, S_local, H)
        weight = output_head(self.model).weight  # (V, H)
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) \
            else weight.dtype
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        if labels is not None:
            return bucket_sums(hidden, weight, labels, position_ids, width=width,
                               buckets=buckets, chunk_tokens=self.chunk_tokens)
        here = position_ids == at  # (B, S_local)
        index = here.int().argmax(dim=1)  # (B,) where it is (0 when it is not here)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        last = hidden[rows, index] * here.any(dim=1, keepdim=True).to(dtype)  # (B, H) or zeros
        return (last @ weight.T).float()  # (B, V)


def load_weights(module: nn.Module, checkpoint: str | Path) -> None:
    """Load a training checkpoint's model weights into ``module`` (collective: every rank).

    Args:
        module: the distributed `EvalModel` (FSDP2-sharded or replicated).
        checkpoint: a checkpoint folder (``.../checkpoints/step-XXXXXXXX``).

    Raises:
        UserError: the checkpoint does not hold this model's weights.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(module)
    try:
        dcp.load({"model": state}, checkpoint_id=str(checkpoint))
    except (RuntimeError, ValueError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UserError(f"the checkpoint {checkpoint} does not hold the weights of the run's "
                        f"model ({type(error).__name__}: {first[:200]}); its config.yaml "
                        "describes another model") from None
    set_model_state_dict(module, state)
