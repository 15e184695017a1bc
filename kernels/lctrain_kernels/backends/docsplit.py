"""The docsplit backend: document-masked blocks as dense calls of a fast kernel, plus a masked rest.

cuDNN's attention runs dense causal blocks well above our Triton kernel but takes no document
mask. :func:`lctrain_kernels.docsplit.split_block` plans a block as dense calls (FULL, or
causal from the top-left) and masked calls, priced by a cost model that falls back to one
masked call for the whole block where splitting would not pay; this backend runs the plan:

* a dense call reads VIEWS of the block's rows where it can — ``n`` adjacent equal documents
  as a batch of ``n`` (B = 1: ``(1, n·L, H, D)`` viewed as ``(n, L, H, D)``, no copy), a
  padded square as the rows from its document's start — and otherwise gathers its entries
  with one ``index_select`` per tensor; it runs on the dense backend (``cudnn`` on CUDA,
  ``cpu_flash`` on a CPU);
* a masked call runs rows of the block under the block's own mask (shifted to its first row)
  on the masked backend (``triton`` on CUDA, ``reference`` on a CPU); the packed call gathers
  whole documents and runs them with their own bounds;
* results go straight into the block's output where one call computes the rows (a copy, an
  ``index_copy_`` for gathered calls, nothing at all when one view call computes the whole
  block); rows that several calls compute (a document's FULL and CAUSAL parts, keys cut off
  a piece, and in the backward the keys of a cut-down document and of its leftover rows) are
  combined once at the end (:mod:`lctrain_kernels.combine`: merged through the lse, gradients
  summed, in float32). Rows no call reaches get out = 0, lse = -inf, zero gradients.

The backward runs the same calls with the FINAL out and lse of their rows. A padded square's
borrowed rows get lse = +inf there: their probabilities ``exp(s - lse)`` are exactly 0, so they
move no gradient into the document's keys, whatever their queries and dO. GQA gradients come
back summed per group from the inner backends.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lctrain_kernels.backends import BackendUnavailable, get_backend
from lctrain_kernels.backends.docsplit_rows import (Keep, Rows, batch, batch_lse, gather,
                                                    gather_index, gather_lse, packed_index,
                                                    select, unbatch, unbatch_lse, view_runs)
from lctrain_kernels.distributed.accumulate import lse_dtype
from lctrain_kernels.docsplit import (MIN_DENSE, MIN_DENSE_CPU, SHAPE_STEPS, DenseCall, Split,
                                      layout, split_block)
from lctrain_kernels.docsplit_cost import CPU_MODEL, GPU_MODEL, CostModel
from lctrain_kernels.masks import MaskSpec, Relation, classify


class _Grad(NamedTuple):
    """The backward's inputs (block tensors) and scale."""

    do: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dlse: torch.Tensor | None
    scale: float


def _dense_mask(call: DenseCall) -> tuple[MaskSpec, Relation]:
    piece = MaskSpec(call.causal)
    return piece, classify(piece, call.sq, call.sk)


def _dense_forward(be, call: DenseCall, cid: int, q, k, v, scale: float, rows: Rows) -> None:
    """Run one dense call and hand its real rows to ``rows``."""
    (piece, rel), b = _dense_mask(call), q.shape[0]
    if call.gather:
        ix = gather_index(call, q.shape[1], k.shape[1], q.device)
        out, lse = be.forward(gather(q, ix.q, call.n), gather(k, ix.k, call.n),
                              gather(v, ix.k, call.n), piece, rel, scale)
        rows.scatter(ix.dst_q, (select(unbatch(out, b), ix.src_q, 1),
                                select(unbatch_lse(lse, b), ix.src_q, 2)))
        return
    for first, n in view_runs(call, [q], [k, v]):
        q0, k0 = call.q0[first], call.k0[first]
        out, lse = be.forward(batch(q, q0, n, call.sq), batch(k, k0, n, call.sk),
                              batch(v, k0, n, call.sk), piece, rel, scale)
        real = n * call.sq if n > 1 else call.rows[first]
        rows.put(cid, q0, q0 + real,
                 (unbatch(out, b)[:, :real], unbatch_lse(lse, b)[:, :, :real]))


def _dense_backward(be, call: DenseCall, cid: int, g: _Grad, qrows: Rows, krows: Rows) -> None:
    """Run one dense call's backward and hand its real rows' gradients to ``qrows`` / ``krows``."""
    (piece, rel), b, n = _dense_mask(call), g.q.shape[0], call.n
    if call.gather:
        ix = gather_index(call, g.q.shape[1], g.k.shape[1], g.q.device)
        grads = be.backward(gather(g.do, ix.q, n), gather(g.q, ix.q, n), gather(g.k, ix.k, n),
                            gather(g.v, ix.k, n), gather(g.out, ix.q, n),
                            gather_lse(g.lse, ix.q, n, ix.pad), piece, rel, g.scale,
                            None if g.dlse is None else gather_lse(g.dlse, ix.q, n))
        qrows.scatter(ix.dst_q, (select(unbatch(grads[0], b), ix.src_q, 1),))
        krows.scatter(ix.dst_k, tuple(select(unbatch(x, b), ix.src_k, 1) for x in grads[1:]))
        return
    for first, n in view_runs(call, [g.do, g.q, g.out], [g.k, g.v]):
        q0, k0, sq, sk = call.q0[first], call.k0[first], call.sq, call.sk
        pad = call.rows[first] if n == 1 else None
        grads = be.backward(batch(g.do, q0, n, sq), batch(g.q, q0, n, sq),
                            batch(g.k, k0, n, sk), batch(g.v, k0, n, sk),
                            batch(g.out, q0, n, sq), batch_lse(g.lse, q0, n, sq, pad), piece,
                            rel, g.scale, None if g.dlse is None else batch_lse(g.dlse, q0, n, sq))
        real_q = n * sq if n > 1 else call.rows[first]
        real_k = n * sk if n > 1 else call.keys(first)
        qrows.put(cid, q0, q0 + real_q, (unbatch(grads[0], b)[:, :real_q],))
        krows.put(cid, k0, k0 + real_k, tuple(unbatch(x, b)[:, :real_k] for x in grads[1:]))


def _masked_blocks(plan: Split, spec: MaskSpec):
    """Yield (call number, mask, relation, query rows, key rows) of each in-place masked call."""
    for j, call in enumerate(plan.masked):
        sub = MaskSpec(spec.causal, spec.q_start + call.q0, spec.k_start + call.k0,
                       spec.doc_bounds)
        rel = classify(sub, call.q1 - call.q0, call.k1 - call.k0)
        yield len(plan.dense) + j, sub, rel, slice(call.q0, call.q1), slice(call.k0, call.k1)


def _packed_mask(plan: Split, spec: MaskSpec, device):
    """(call number, mask, relation, query index, key index) of the packed call."""
    call = plan.packed
    sub, total = MaskSpec(spec.causal, 0, 0, call.bounds), sum(call.n)
    return (len(plan.dense) + len(plan.masked), sub, classify(sub, total, total),
            *packed_index(call, device))


class DocSplitBackend:
    """Dense kernels on the documents of a block, a masked kernel on the rest.

    Args:
        dense: backend of the dense calls; None picks ``cudnn`` on CUDA, ``cpu_flash`` else.
        masked: backend of the masked calls; None picks ``triton`` on CUDA, ``reference``
            else.
        min_dense: fewest rows of a dense piece (see :mod:`lctrain_kernels.docsplit`); None
            picks ``MIN_DENSE`` on CUDA, ``MIN_DENSE_CPU`` else.
        shape_steps: dense row counts per octave (0: exact document lengths).
        model: the plan's prices (:mod:`lctrain_kernels.docsplit_cost`); None picks
            ``GPU_MODEL`` on CUDA, ``CPU_MODEL`` else.
        force_dense: run every document of ``min_dense`` rows or more dense, never the whole
            block masked (to measure what the cost model avoids).
    """

    name = "docsplit"

    def __init__(self, dense: str | None = None, masked: str | None = None, *,
                 min_dense: int | None = None, shape_steps: int = SHAPE_STEPS,
                 model: CostModel | None = None, force_dense: bool = False):
        self.dense, self.masked = dense, masked
        self.min_dense, self.shape_steps = min_dense, shape_steps
        self.model, self.force_dense = model, force_dense

    def _names(self, q: torch.Tensor) -> tuple[str, str]:
        """Names of the (dense, masked) backends for tensors like ``q``."""
        return (self.dense or ("cudnn" if q.is_cuda else "cpu_flash"),
                self.masked or ("triton" if q.is_cuda else "reference"))

    def _inner(self, q: torch.Tensor):
        """The (dense, masked) backend objects for tensors like ``q``."""
        return tuple(get_backend(name) for name in self._names(q))

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        (dense_name, masked_name), probe = self._names(q), MaskSpec(True)  # a dense piece
        for name, args in ((dense_name, (probe, Relation.CAUSAL)), (masked_name, (spec, relation))):
            try:
                reason = get_backend(name).unsupported(q, k, v, *args)
            except BackendUnavailable as exc:
                reason = str(exc)
            if reason is not None:
                return f"the docsplit backend runs parts of the block on {name}, and {reason}"
        return None

    def plan(self, q: torch.Tensor, spec: MaskSpec, sk: int) -> Split:
        """The :class:`~lctrain_kernels.docsplit.Split` this backend runs for a block."""
        min_dense = self.min_dense
        if min_dense is None:
            min_dense = MIN_DENSE if q.is_cuda else MIN_DENSE_CPU
        model = self.model or (GPU_MODEL if q.is_cuda else CPU_MODEL)
        b, _, h, d = q.shape
        return split_block(spec, q.shape[1], sk, min_dense, self.shape_steps, model, b * h * d,
                           self.force_dense)

    def forward(self, q, k, v, spec: MaskSpec, relation: Relation, scale: float):
        sq, sk = q.shape[1], k.shape[1]
        plan, (dense, masked) = self.plan(q, spec, sk), self._inner(q)
        if not plan.dense:  # one masked call for the whole block
            return masked.forward(q, k, v, spec, relation, scale)
        lay, b = layout(plan, sq, sk), q.shape[0]
        if lay.whole and len(view_runs(plan.dense[0], [q], [k, v])) == 1:
            keep = Keep()
            _dense_forward(dense, plan.dense[0], 0, q, k, v, scale, keep)
            return keep.parts
        out = torch.empty_like(q)  # (B, Sq, Hq, D)
        lse = q.new_empty((b, q.shape[2], sq), dtype=lse_dtype(q.dtype))  # (B, Hq, Sq)
        rows = Rows((out, lse), (1, 2), lay.shared_q, True)
        for cid, call in enumerate(plan.dense):
            _dense_forward(dense, call, cid, q, k, v, scale, rows)
        for cid, sub, rel, r, c in _masked_blocks(plan, spec):
            if rel is Relation.EMPTY:
                rows.nothing(cid, r.start, r.stop)
                continue
            rows.put(cid, r.start, r.stop,
                     masked.forward(q[:, r], k[:, c], v[:, c], sub, rel, scale))
        if plan.packed is not None:
            _, sub, rel, iq, ik = _packed_mask(plan, spec, q.device)
            rows.scatter(iq, masked.forward(q.index_select(1, iq), k.index_select(1, ik),
                                            v.index_select(1, ik), sub, rel, scale))
        return rows.finish(lay.free_q)  # (B, Sq, Hq, D), (B, Hq, Sq)

    def backward(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation, scale: float,
                 dlse=None):
        """Every call covering a row gets that row's dlse: each moves only its own keys."""
        sq, sk = q.shape[1], k.shape[1]
        plan, (dense, masked) = self.plan(q, spec, sk), self._inner(q)
        if not plan.dense:
            return masked.backward(do, q, k, v, out, lse, spec, relation, scale, dlse)
        lay, g = layout(plan, sq, sk), _Grad(do, q, k, v, out, lse, dlse, scale)
        if lay.whole and len(view_runs(plan.dense[0], [do, q, out], [k, v])) == 1:
            keep_q, keep_k = Keep(), Keep()
            _dense_backward(dense, plan.dense[0], 0, g, keep_q, keep_k)
            return keep_q.parts[0], *keep_k.parts
        qrows = Rows((torch.empty_like(q),), (1,), lay.shared_q, False)
        krows = Rows((torch.empty_like(k), torch.empty_like(v)), (1, 1), lay.shared_k, False)
        for cid, call in enumerate(plan.dense):
            _dense_backward(dense, call, cid, g, qrows, krows)
        for cid, sub, rel, r, c in _masked_blocks(plan, spec):
            if rel is Relation.EMPTY:
                qrows.nothing(cid, r.start, r.stop)
                krows.nothing(cid, c.start, c.stop)
                continue
            grads = masked.backward(do[:, r], q[:, r], k[:, c], v[:, c], out[:, r], lse[:, :, r],
                                    sub, rel, scale, None if dlse is None else dlse[:, :, r])
            qrows.put(cid, r.start, r.stop, grads[:1])
            krows.put(cid, c.start, c.stop, grads[1:])
        if plan.packed is not None:
            _, sub, rel, iq, ik = _packed_mask(plan, spec, q.device)
            grads = masked.backward(*(x.index_select(1, i) for x, i in ((do, iq), (q, iq), (k, ik),
                                                                     (v, ik), (out, iq))),
                                    lse.index_select(2, iq), sub, rel, scale,
                                    None if dlse is None else dlse.index_select(2, iq))
            qrows.scatter(iq, grads[:1])
            krows.scatter(ik, grads[1:])
        return qrows.finish(lay.free_q)[0], *krows.finish(lay.free_k)
