"""Backend on the flash-attn package (Dao-AILab), used only when it is installed.

flash-attn 2 takes BSHD tensors and GQA directly (K/V with fewer heads; its backward sums dK/dV
over each group itself), returns the log-sum-exp ``(B, H, Sq)`` float32 from
``flash_attn_func(..., return_attn_probs=True)``, and its low-level ``_flash_attn_backward``
accepts the output and lse we hand it — the MERGED ones — computing ``delta = rowsum(dO * O)``
from them (so a gradient of the lse takes one more backward, see
:class:`~lctrain_kernels.backends.base.UnitValueLseGrad`). Signature relied on (flash-attn >= 2.7)::

    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left, window_size_right, softcap, alibi_slopes,
                         deterministic, rng_state=None)   # writes dq, dk, dv in place

Like torch's SDPA ops it knows no mask but "causal", so it computes FULL and CAUSAL blocks only,
and square CAUSAL ones only: its causal mask is aligned bottom-right, lctrain's top-left.
"""
from __future__ import annotations

import torch

from lctrain_kernels.backends.base import BackendUnavailable, UnitValueLseGrad
from lctrain_kernels.backends.sdpa import half_head_dim_reason, square_causal_reason
from lctrain_kernels.masks import MaskSpec, Relation

_MIN_VERSION = (2, 7)


def _load():
    try:
        import flash_attn
        from flash_attn import flash_attn_func
        from flash_attn.flash_attn_interface import _flash_attn_backward
    except ImportError as exc:
        raise BackendUnavailable("the flash_attn backend needs the flash-attn package, which "
                                 "is not installed; install lctrain[flash].") from exc
    version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2])
    if version < _MIN_VERSION:
        raise BackendUnavailable(f"the flash_attn backend needs flash-attn >= 2.7, found "
                                 f"{flash_attn.__version__}; install lctrain[flash].")
    return flash_attn_func, _flash_attn_backward


class FlashAttnBackend(UnitValueLseGrad):
    """flash-attn 2 kernels; CUDA, fp16/bf16, FULL/CAUSAL blocks, native GQA."""

    name = "flash_attn"

    def __init__(self):
        self._forward, self._backward = _load()

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        if not q.is_cuda:
            return f"the flash_attn backend runs on CUDA only, and the tensors are on {q.device}."
        if relation not in (Relation.FULL, Relation.CAUSAL):
            return (f"the flash_attn backend computes only full or causal blocks, not a "
                    f"{relation.value} one; use triton or reference.")
        return (square_causal_reason(self.name, q, k, relation)
                or half_head_dim_reason(self.name, q, 256))

    def forward(self, q, k, v, spec, relation, scale):
        with torch.no_grad():
            out, lse, _ = self._forward(q, k, v, dropout_p=0.0, softmax_scale=scale,
                                        causal=relation is Relation.CAUSAL,
                                        return_attn_probs=True)
        return out, lse[..., :q.shape[1]].float()  # (B, Sq, Hq, D), (B, Hq, Sq)

    def grads(self, do, q, k, v, out, lse, spec, relation, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._backward(do.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(),
                       v.contiguous(), out.to(q.dtype).contiguous(), lse.float().contiguous(),
                       dq, dk, dv, 0.0, scale, relation is Relation.CAUSAL, -1, -1, 0.0, None,
                       False, None)
        return dq, dk, dv
