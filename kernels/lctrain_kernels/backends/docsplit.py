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

import functools
from typing import NamedTuple

import torch

from lctrain_kernels.backends import BackendUnavailable, get_backend
from lctrain_kernels.combine import merge_many_into, sum_into
from lctrain_kernels.distributed.accumulate import lse_dtype
from lctrain_kernels.docsplit import (MIN_DENSE, MIN_DENSE_CPU, SHAPE_STEPS, DenseCall,
                                      PackedCall, Split, layout, split_block)
from lctrain_kernels.docsplit_cost import CPU_MODEL, GPU_MODEL, CostModel
from lctrain_kernels.masks import MaskSpec, Relation, classify

_INF = float("inf")


class _Index(NamedTuple):
    """Device indices of a gathered call: rows read into the batch (clamped to the block),
    positions of its real rows in the batch (None: all are real) and their block rows, for
    queries and for keys; ``pad``: (n, sq) bool, the borrowed rows (None: none)."""

    q: torch.Tensor
    k: torch.Tensor
    src_q: torch.Tensor | None
    dst_q: torch.Tensor
    src_k: torch.Tensor | None
    dst_k: torch.Tensor
    pad: torch.Tensor | None


def _device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index on ``device`` without stalling the host (pinned, asynchronous copy)."""
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


@functools.lru_cache(maxsize=256)
def _gather_index(call: DenseCall, sq: int, sk: int, device: torch.device) -> _Index:
    """The indices of a gathered dense call (built once per call and device, then cached)."""
    tq, tk = torch.arange(call.sq), torch.arange(call.sk)
    q = torch.cat([(a + tq).clamp_(max=sq - 1) for a in call.q0])
    k = torch.cat([(a + tk).clamp_(max=sk - 1) for a in call.k0])
    real_q = torch.cat([tq < r for r in call.rows])  # (n*sq,)
    real_k = torch.cat([tk < call.keys(i) for i in range(call.n)])
    src_q, src_k = real_q.nonzero().flatten(), real_k.nonzero().flatten()
    return _Index(_device(q, device), _device(k, device),
                  _device(src_q, device) if call.padded else None, _device(q[src_q], device),
                  _device(src_k, device) if call.padded else None, _device(k[src_k], device),
                  _device(~real_q.view(call.n, call.sq), device) if call.padded else None)


@functools.lru_cache(maxsize=64)
def _packed_index(call: PackedCall, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block rows of the packed call's queries and keys, in packed order."""
    q = torch.cat([torch.arange(a, a + n) for a, n in zip(call.q0, call.n)])
    k = torch.cat([torch.arange(a, a + n) for a, n in zip(call.k0, call.n)])
    return _device(q, device), _device(k, device)


def _batch(x: torch.Tensor, start: int, n: int, length: int) -> torch.Tensor:
    """Rows ``start ... start + n*length`` of x as a batch (B*n, length, ...): a view (the
    caller checks :func:`_viewable`)."""
    part = x[:, start:start + n * length]  # (B, n*length, ...)
    return part if n == 1 else part.view(x.shape[0] * n, length, *x.shape[2:])


def _batch_lse(lse: torch.Tensor, start: int, n: int, length: int, pad_from: int | None = None):
    """The lse (B, H, S) of the same rows as (B*n, H, length); with ``pad_from``, a copy whose
    rows from there on are +inf (a padded square's borrowed rows)."""
    b, h, _ = lse.shape
    part = lse[:, :, start:start + n * length]  # (B, H, n*length)
    if n > 1:
        return part.reshape(b, h, n, length).transpose(1, 2).reshape(b * n, h, length)
    if pad_from is not None and pad_from < length:
        part = part.clone()
        part[:, :, pad_from:] = _INF
    return part


def _gather(x: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``index`` of x (B, S, ...) as a batch (B*n, len(index)/n, ...)."""
    g = x.index_select(1, index)  # (B, n*L, ...)
    return g.view(x.shape[0] * n, -1, *x.shape[2:])


def _gather_lse(lse: torch.Tensor, index: torch.Tensor, n: int, pad=None) -> torch.Tensor:
    """Columns ``index`` of an lse (B, H, S) as (B*n, H, L); ``pad`` (n, L) rows set to +inf."""
    b, h, _ = lse.shape
    g = lse.index_select(2, index).view(b, h, n, -1)  # (B, H, n, L)
    if pad is not None:
        g = g.masked_fill(pad, _INF)
    return g.transpose(1, 2).reshape(b * n, h, -1)


def _unbatch(x: torch.Tensor, b: int) -> torch.Tensor:
    """(B*n, L, ...) -> (B, n*L, ...)."""
    return x.reshape(b, -1, *x.shape[2:])


def _unbatch_lse(lse: torch.Tensor, b: int) -> torch.Tensor:
    """(B*n, H, L) -> (B, H, n*L)."""
    bn, h, length = lse.shape
    return lse.reshape(b, bn // b, h, length).transpose(1, 2).reshape(b, h, -1)


def _select(x: torch.Tensor, index: torch.Tensor | None, dim: int) -> torch.Tensor:
    return x if index is None else x.index_select(dim, index)


def _viewable(x: torch.Tensor, n: int, length: int) -> bool:
    """Whether n adjacent pieces of ``length`` rows of x view as one batch (B = 1, or the
    pieces hold all of x's rows)."""
    return n == 1 or x.shape[0] == 1 or x.stride(0) == n * length * x.stride(1)


def _view_runs(call: DenseCall, rows: list[torch.Tensor], keys: list[torch.Tensor]):
    """(first entry, count) of each view call that runs ``call``: all its entries at once,
    or (a batch that cannot be a view of every tensor, B > 1) one entry at a time."""
    if (all(_viewable(t, call.n, call.sq) for t in rows)
            and all(_viewable(t, call.n, call.sk) for t in keys)):
        return [(0, call.n)]
    return [(i, 1) for i in range(call.n)]


class _Rows:
    """The block's result tensors of one side (query rows: out and lse, or dq; key rows: dk
    and dv), filled call by call: rows that one call computes are written at once; parts of
    calls that share rows are kept and combined once in :meth:`finish`."""

    def __init__(self, dsts: tuple[torch.Tensor, ...], dims: tuple[int, ...], shared, merge):
        self.dsts, self.dims, self.shared, self.merge = dsts, dims, shared, merge
        self.parts: list[tuple[int, int, tuple[torch.Tensor, ...]]] = []
        self.unset: list[tuple[int, int]] = []  # rows of shared calls that saw nothing

    def _narrow(self, tensors, a: int, n: int) -> list[torch.Tensor]:
        return [t.narrow(dim, a, n) for t, dim in zip(tensors, self.dims)]

    def put(self, call: int, a: int, b: int, parts: tuple[torch.Tensor, ...]) -> None:
        """Call ``call``'s result for rows ``[a, b)``."""
        if call in self.shared:
            self.parts.append((a, b, parts))
            return
        for dst, src in zip(self._narrow(self.dsts, a, b - a), parts):
            dst.copy_(src)

    def nothing(self, call: int, a: int, b: int) -> None:
        """Call ``call`` sees no pair in rows ``[a, b)`` (skipped)."""
        if call in self.shared:
            self.unset.append((a, b))
        else:
            self.identity(a, b)

    def scatter(self, index: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> None:
        """Rows ``index`` of a gathered call (never shared: the plan gathers whole documents)."""
        for dst, dim, src in zip(self.dsts, self.dims, parts):
            dst.index_copy_(dim, index, src.to(dst.dtype))

    def identity(self, a: int, b: int) -> None:
        """Rows ``[a, b)`` that no call computes: out 0 and lse -inf, or zero gradients."""
        for i, t in enumerate(self._narrow(self.dsts, a, b - a)):
            t.fill_(-_INF if self.merge and i == 1 else 0)

    def finish(self, free) -> tuple[torch.Tensor, ...]:
        """Combine the shared parts, fill the rows nobody computed; the result tensors."""
        cuts = sorted({x for a, b, _ in self.parts for x in (a, b)}
                      | {x for r in self.unset for x in r})
        for lo, hi in zip(cuts, cuts[1:]):
            covering = [self._narrow(ts, lo - a, hi - lo) for a, b, ts in self.parts
                        if a <= lo and hi <= b]
            target = self._narrow(self.dsts, lo, hi - lo)
            if len(covering) == 1:
                for d, s in zip(target, covering[0]):
                    d.copy_(s)
            elif covering and self.merge:
                merge_many_into(target[0], target[1], [tuple(c) for c in covering])
            elif covering:
                for j, d in enumerate(target):
                    sum_into(d, [c[j] for c in covering])
            elif any(a <= lo and hi <= b for a, b in self.unset):
                self.identity(lo, hi)
        for a, b in free:
            self.identity(a, b)
        return self.dsts


class _Keep:
    """Takes the one result of a plan whose single view call computes the whole block."""

    def __init__(self):
        self.parts: tuple[torch.Tensor, ...] = ()

    def put(self, call: int, a: int, b: int, parts: tuple[torch.Tensor, ...]) -> None:
        self.parts = parts


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


def _dense_forward(be, call: DenseCall, cid: int, q, k, v, scale: float, rows: _Rows) -> None:
    """Run one dense call and hand its real rows to ``rows``."""
    (piece, rel), b = _dense_mask(call), q.shape[0]
    if call.gather:
        ix = _gather_index(call, q.shape[1], k.shape[1], q.device)
        out, lse = be.forward(_gather(q, ix.q, call.n), _gather(k, ix.k, call.n),
                              _gather(v, ix.k, call.n), piece, rel, scale)
        rows.scatter(ix.dst_q, (_select(_unbatch(out, b), ix.src_q, 1),
                                _select(_unbatch_lse(lse, b), ix.src_q, 2)))
        return
    for first, n in _view_runs(call, [q], [k, v]):
        q0, k0 = call.q0[first], call.k0[first]
        out, lse = be.forward(_batch(q, q0, n, call.sq), _batch(k, k0, n, call.sk),
                              _batch(v, k0, n, call.sk), piece, rel, scale)
        real = n * call.sq if n > 1 else call.rows[first]
        rows.put(cid, q0, q0 + real,
                 (_unbatch(out, b)[:, :real], _unbatch_lse(lse, b)[:, :, :real]))


def _dense_backward(be, call: DenseCall, cid: int, g: _Grad, qrows: _Rows, krows: _Rows) -> None:
    """Run one dense call's backward and hand its real rows' gradients to ``qrows`` / ``krows``."""
    (piece, rel), b, n = _dense_mask(call), g.q.shape[0], call.n
    if call.gather:
        ix = _gather_index(call, g.q.shape[1], g.k.shape[1], g.q.device)
        grads = be.backward(_gather(g.do, ix.q, n), _gather(g.q, ix.q, n), _gather(g.k, ix.k, n),
                            _gather(g.v, ix.k, n), _gather(g.out, ix.q, n),
                            _gather_lse(g.lse, ix.q, n, ix.pad), piece, rel, g.scale,
                            None if g.dlse is None else _gather_lse(g.dlse, ix.q, n))
        qrows.scatter(ix.dst_q, (_select(_unbatch(grads[0], b), ix.src_q, 1),))
        krows.scatter(ix.dst_k, tuple(_select(_unbatch(x, b), ix.src_k, 1) for x in grads[1:]))
        return
    for first, n in _view_runs(call, [g.do, g.q, g.out], [g.k, g.v]):
        q0, k0, sq, sk = call.q0[first], call.k0[first], call.sq, call.sk
        pad = call.rows[first] if n == 1 else None
        grads = be.backward(_batch(g.do, q0, n, sq), _batch(g.q, q0, n, sq),
                            _batch(g.k, k0, n, sk), _batch(g.v, k0, n, sk),
                            _batch(g.out, q0, n, sq), _batch_lse(g.lse, q0, n, sq, pad), piece,
                            rel, g.scale, None if g.dlse is None else _batch_lse(g.dlse, q0, n, sq))
        real_q = n * sq if n > 1 else call.rows[first]
        real_k = n * sk if n > 1 else call.keys(first)
        qrows.put(cid, q0, q0 + real_q, (_unbatch(grads[0], b)[:, :real_q],))
        krows.put(cid, k0, k0 + real_k, tuple(_unbatch(x, b)[:, :real_k] for x in grads[1:]))


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
            *_packed_index(call, device))


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
        if lay.whole and len(_view_runs(plan.dense[0], [q], [k, v])) == 1:
            keep = _Keep()
            _dense_forward(dense, plan.dense[0], 0, q, k, v, scale, keep)
            return keep.parts
        out = torch.empty_like(q)  # (B, Sq, Hq, D)
        lse = q.new_empty((b, q.shape[2], sq), dtype=lse_dtype(q.dtype))  # (B, Hq, Sq)
        rows = _Rows((out, lse), (1, 2), lay.shared_q, True)
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
        if lay.whole and len(_view_runs(plan.dense[0], [do, q, out], [k, v])) == 1:
            keep_q, keep_k = _Keep(), _Keep()
            _dense_backward(dense, plan.dense[0], 0, g, keep_q, keep_k)
            return keep_q.parts[0], *keep_k.parts
        qrows = _Rows((torch.empty_like(q),), (1,), lay.shared_q, False)
        krows = _Rows((torch.empty_like(k), torch.empty_like(v)), (1, 1), lay.shared_k, False)
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
