"""torch's own context parallelism as a training schedule: the peer lctrain is measured against.

With ``parallel.schedule: context_parallel`` the same model, data, checkpointing policy, FSDP2
and loop run, but each attention call goes through torch's
``torch.distributed.tensor.experimental.context_parallel`` (a ring over SDPA's cuDNN or flash
kernel with head-tail load balancing) instead of `lctrain_kernels.dist_attention`:

- `lctrain.parallel.context.ContextParallel` shards every micro-batch itself, in the zigzag
  layout (rank r holds chunks r and 2P−1−r of 2P), the order torch's head-tail load balancer
  expects, and enters this module's session around it;
- `TorchContextParallel.session` keeps torch's context active around one micro-batch's forward
  AND backward (torch's SDPA backward must also see it), with SDPA limited to the kernels
  torch shards (cuDNN first — the local kernel lctrain's ``auto`` picks on Hopper — then flash,
  then memory-efficient for float32); the first micro-batch run through it checks that
  torch's sharding of a probe of global positions equals ours;
- the model runs this module's own attention function (`torch_cp_attention`, registered in
  transformers' ``AttentionInterface`` as ``"lctrain_torch_cp"``), which calls `ring_attention`,
  i.e. plain ``F.scaled_dot_product_attention(..., is_causal=True)``, which torch has patched
  to run the ring on this rank's shard.

torch shards SDPA only on CUDA (no CPU sharding rule), and its ring has no document mask, so
the schedule needs GPUs and ``data.document_mask: false`` (the config checks the latter).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

from lctrain.errors import UserError
from lctrain.model.attention import checked_inputs
from lctrain_kernels.distributed.layout import shard_indices

ATTENTION_NAME = "lctrain_torch_cp"
"""The ``attn_implementation`` name of `torch_cp_attention`."""

_PLAIN_SDPA = F.scaled_dot_product_attention  # torch's context patches the module attribute


def check_available(device_type: str) -> None:
    """Raise a UserError unless torch's context parallelism can run on this device type."""
    if device_type != "cuda":
        raise UserError("parallel.schedule context_parallel runs torch's ring attention, which "
                        "needs CUDA GPUs (torch has no CPU sharding rule for SDPA); use "
                        "distflash, ring or zigzag on this machine.")


class TorchContextParallel:
    """torch's context parallelism over one cp group, entered once per micro-batch.

    Args:
        cp_mesh: the 1-D DeviceMesh of the cp ranks.
        cp_rank: this rank's index in it.
        device: this rank's CUDA device.
    """

    def __init__(self, cp_mesh: DeviceMesh, cp_rank: int, device: torch.device) -> None:
        self.mesh, self.cp_rank, self.device = cp_mesh, cp_rank, device
        self.checked: set[int] = set()  # sequence lengths whose layout has been compared

    @contextlib.contextmanager
    def session(self, seq_len: int) -> Iterator[None]:
        """torch's context parallelism for one forward + backward of ``seq_len`` total tokens.

        Raises:
            RuntimeError: torch's head-tail sharding does not match lctrain's zigzag layout.
        """
        probe = torch.arange(seq_len, device=self.device)[None]  # (1, S) global positions
        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION]  # in this order: float32 only has the last
        with sdpa_kernel(backends, set_priority=True), \
                context_parallel(self.mesh, buffers=[probe], buffer_seq_dims=[1],
                                 no_restore_buffers={probe}):
            if seq_len not in self.checked:
                self._check_layout(probe[0], seq_len)
            yield

    def _check_layout(self, torch_positions: torch.Tensor, seq_len: int) -> None:
        ours = shard_indices(seq_len, self.mesh.size(), self.cp_rank, "zigzag")
        if not torch.equal(torch_positions.cpu(), ours):
            raise RuntimeError(f"torch's context_parallel shards a {seq_len}-token sequence "
                               f"differently from lctrain's zigzag layout on cp rank "
                               f"{self.cp_rank}; this torch version is not supported as a peer.")
        self.checked.add(seq_len)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scale: float | None) -> torch.Tensor:
    """Causal attention of this rank's shard through torch's patched SDPA.

    Args:
        query: (B, Hq, S_local, D); key, value: (B, Hkv, S_local, D) — zigzag shards.
        scale: softmax scale (None: 1/sqrt(D)).

    Returns:
        (B, Hq, S_local, D).

    Raises:
        RuntimeError: called outside `TorchContextParallel.session`.
    """
    if F.scaled_dot_product_attention is _PLAIN_SDPA:
        raise RuntimeError("the context_parallel schedule's attention ran outside torch's "
                           "context; the training loop must enter TorchContextParallel.session.")
    gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, **gqa)


def torch_cp_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       scaling: float | None = None, dropout: float = 0.0,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function of the peer schedule: torch's ring over the cp group.

    Args:
        module: the calling attention module (checked for unsupported features).
        query: (B, Hq, S_local, D); key, value: (B, Hkv, S_local, D) — zigzag shards, RoPE
            applied, heads not repeated.
        attention_mask: must be None.
        scaling: softmax scale (default 1/sqrt(D)).
        dropout: must be 0.
        **kwargs: ``cp_context`` (`lctrain.model.CPContext`), whose ``cu_seqlens`` must be None.

    Returns:
        (out (B, S_local, Hq, D), None).

    Raises:
        ValueError: a document mask, dropout, a sliding window or an attention mask was given.
        RuntimeError: called outside `TorchContextParallel.session`.
    """
    query, key, value = checked_inputs(module, query, key, value, attention_mask, dropout,
                                       kwargs)
    ctx = kwargs.get("cp_context")
    if ctx is not None and ctx.cu_seqlens is not None:
        raise ValueError("the context_parallel schedule has no document mask; train with "
                         "data.document_mask=false.")
    return ring_attention(query, key, value, scaling).transpose(1, 2), None  # (B, S, Hq, D)


def register_attention() -> str:
    """Register `torch_cp_attention` in transformers' AttentionInterface (idempotent).

    Returns:
        The name to pass as ``attn_implementation``.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, torch_cp_attention)
    return ATTENTION_NAME
