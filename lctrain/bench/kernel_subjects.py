"""What ``lctrain bench kernel`` can time: lctrain's local backends and outside peers.

Each subject hands back two closures for one input, timed alike: ``fwd() -> (out, lse)`` and
``bwd(state) -> (dq, dk, dv)``. `BackendSubject`'s backward takes one forward's out and lse, as
training calls it; `FlexAttention` (torch's compiled ``flex_attention`` with a block mask, a peer of
lctrain's Triton kernels) runs autograd over a graph kept from one forward."""
from __future__ import annotations

from typing import Any, Callable

import torch

from lctrain_kernels.api import BackendUnavailable, MaskSpec, Relation, get_backend

Closures = tuple[Callable[[], Any], Callable[[Any], Any]]
PEERS = ("flex_attention",)


class BackendSubject:
    """An lctrain attention backend, timed through its forward and backward entry points."""

    def __init__(self, name: str):
        self.backend = get_backend(name)  # BackendUnavailable: unknown or not installed
        self.name = name
        self.unsupported = self.backend.unsupported  # None, or one sentence why not

    def closures(self, q, k, v, do, spec: MaskSpec, relation: Relation, scale: float) -> Closures:
        """(fwd, bwd) on these inputs; the backward uses one forward's out and lse."""
        backend = self.backend
        out, lse = backend.forward(q, k, v, spec, relation, scale)
        return (lambda: backend.forward(q, k, v, spec, relation, scale),
                lambda _state: backend.backward(do, q, k, v, out, lse, spec, relation, scale))


class FlexAttention:
    """torch's flex_attention with a block mask (see the module docstring)."""

    name = "flex_attention"

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        """None if flex_attention can run this request here, else one sentence why not."""
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            return "this torch has no torch.nn.attention.flex_attention"
        if q.device.type != "cuda":
            return "flex_attention has no CPU backward in torch; run it on a GPU"
        if spec.q_start != spec.k_start:
            return "the flex_attention peer times square blocks only"
        return None

    def closures(self, q, k, v, do, spec: MaskSpec, relation: Relation, scale: float) -> Closures:
        """(fwd, bwd): compiled flex_attention forward; autograd backward over a kept graph."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        seq_len = q.shape[1]
        compiled = torch.compile(flex_attention, dynamic=False)
        mask = create_block_mask(_mask_mod(spec, q.device), None, None, seq_len, seq_len,
                                 device=q.device)
        qh, kh, vh = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))  # (B, H, S, D)
        doh = do.transpose(1, 2).contiguous()  # (B, Hq, S, D)
        extra = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}

        def run(*inputs):
            return compiled(*inputs, block_mask=mask, scale=scale, return_lse=True, **extra)

        graph_out, _ = run(qh, kh, vh)

        def fwd():
            with torch.no_grad():
                out, lse = run(qh, kh, vh)
            return out.transpose(1, 2), lse  # (B, S, Hq, D), (B, Hq, S)

        def bwd(_state):
            grads = torch.autograd.grad(graph_out, (qh, kh, vh), doh, retain_graph=True)
            return tuple(g.transpose(1, 2) for g in grads)

        return fwd, bwd


def _mask_mod(spec: MaskSpec, device: torch.device):
    """flex_attention's mask function for a causal and/or document mask."""
    causal = spec.causal
    if spec.doc_bounds is None:
        return (lambda b, h, qi, ki: ki <= qi) if causal else (lambda b, h, qi, ki: qi >= 0)
    bounds = torch.tensor(spec.doc_bounds[1:-1], device=device)
    doc = torch.bucketize(torch.arange(spec.doc_bounds[-1], device=device), bounds, right=True)

    def mask(b, h, qi, ki):
        same = doc[qi] == doc[ki]
        return same & (ki <= qi) if causal else same

    return mask


def subject(name: str):
    """The subject called ``name``: a peer, or an lctrain backend (BackendUnavailable: an
    unknown name or a backend that is not installed)."""
    if name == "flex_attention":
        return FlexAttention()
    try:
        return BackendSubject(name)
    except BackendUnavailable as exc:
        if not str(exc).startswith("unknown"):
            raise
        raise BackendUnavailable(f"{str(exc).rstrip('.')}, or the peer "
                                 f"{' or '.join(PEERS)}.") from None
