"""The docsplit backend: document-masked blocks as dense calls of a fast kernel, plus a masked rest.

cuDNN's attention runs dense causal blocks well above our Triton kernel but takes no document
mask. :func:`lctrain_kernels.docsplit.split_block` cuts a block at its document boundaries into
dense pieces (FULL, or causal from the top-left corner) and a masked rest (short documents and
the last rows of each piece); this backend runs that plan:

* each dense call takes a VIEW of the block's rows — ``n`` adjacent equal documents become a
  batch of ``n`` (B = 1: ``(1, n·L, H, D)`` viewed as ``(n, L, H, D)``, no copy) — on the
  dense backend (``cudnn`` on CUDA, ``cpu_flash`` on a CPU);
* each masked call runs rows of the block under the block's own mask (shifted to its first
  row) on the masked backend (``triton`` on CUDA, ``reference`` on a CPU);
* the partial results are kept and combined once per run of rows
  (:mod:`lctrain_kernels.distributed.accumulate`): a row reached by one call is a copy, a
  row reached by two (a document's FULL and CAUSAL parts, or a piece and its masked rest)
  merges through the lse in float32; one call that covers every row is returned as it is.
  Rows no call reaches get out = 0, lse = -inf.

The backward runs the same calls with the FINAL out and lse of their rows; dq, dk and dv of
the calls are summed per row the same way (GQA gradients come back summed per group from the
inner backends).
"""
from __future__ import annotations

import torch

from lctrain_kernels.backends import BackendUnavailable, get_backend
from lctrain_kernels.distributed.accumulate import GradAcc, OutAcc
from lctrain_kernels.docsplit import (MIN_DENSE, MIN_DENSE_CPU, MIN_DENSE_SHARE, SHAPE_STEPS,
                                      Split, split_block)
from lctrain_kernels.masks import MaskSpec, Relation, classify


def _rows(x: torch.Tensor, start: int, n: int, length: int) -> torch.Tensor:
    """Rows ``start + i*length ...`` of ``n`` adjacent pieces as a batch: (B*n, length, ...).

    A view when :func:`_viewable` says so (the caller checks).
    """
    part = x[:, start:start + n * length]  # (B, n*length, ...)
    if n == 1:
        return part
    return part.view(x.shape[0] * n, length, *x.shape[2:])


def _rows_lse(lse: torch.Tensor, start: int, n: int, length: int) -> torch.Tensor:
    """The lse (B, H, S) of the same rows as a batch: (B*n, H, length)."""
    b, h, _ = lse.shape
    part = lse[:, :, start:start + n * length]  # (B, H, n*length)
    if n == 1:
        return part
    return part.reshape(b, h, n, length).transpose(1, 2).reshape(b * n, h, length)


def _unbatch(x: torch.Tensor, b: int) -> torch.Tensor:
    """(B*n, L, ...) -> (B, n*L, ...)."""
    return x.reshape(b, -1, *x.shape[2:])


def _unbatch_lse(lse: torch.Tensor, b: int) -> torch.Tensor:
    """(B*n, H, L) -> (B, H, n*L)."""
    bn, h, length = lse.shape
    return lse.reshape(b, bn // b, h, length).transpose(1, 2).reshape(b, h, -1)


def _viewable(x: torch.Tensor, n: int, length: int) -> bool:
    """Whether n adjacent pieces of ``length`` rows of x view as one batch (B = 1, or the
    pieces hold all of x's rows)."""
    return n == 1 or x.shape[0] == 1 or x.stride(0) == n * length * x.stride(1)


def _dense_batches(plan: Split, rows: list[torch.Tensor], keys: list[torch.Tensor]):
    """Yield (piece mask, relation, query run, key run) of each batched dense call; a run is
    (first row, n, length). A call whose batch cannot be a view of every tensor (B > 1)
    runs one piece at a time."""
    for call in plan.dense:
        piece = MaskSpec(call.causal)
        rel = classify(piece, call.sq, call.sk)
        if (all(_viewable(t, call.n, call.sq) for t in rows)
                and all(_viewable(t, call.n, call.sk) for t in keys)):
            yield piece, rel, (call.q0, call.n, call.sq), (call.k0, call.n, call.sk)
            continue
        for i in range(call.n):
            q0, k0 = call.q0 + i * call.sq, call.k0 + i * call.sk
            yield piece, rel, (q0, 1, call.sq), (k0, 1, call.sk)


def _masked_blocks(plan: Split, spec: MaskSpec):
    """Yield (mask, relation, query rows, key rows) of each masked call that sees anything."""
    for call in plan.masked:
        sub = MaskSpec(spec.causal, spec.q_start + call.q0, spec.k_start + call.k0,
                       spec.doc_bounds)
        rel = classify(sub, call.q1 - call.q0, call.k1 - call.k0)
        if rel is not Relation.EMPTY:
            yield sub, rel, slice(call.q0, call.q1), slice(call.k0, call.k1)


def _end(run: tuple[int, int, int]) -> int:
    start, n, length = run
    return start + n * length


class DocSplitBackend:
    """Dense kernels on the documents of a block, a masked kernel on the rest.

    Args:
        dense: backend of the dense calls; None picks ``cudnn`` on CUDA, ``cpu_flash`` else.
        masked: backend of the masked calls; None picks ``triton`` on CUDA, ``reference``
            else.
        min_dense: fewest rows of a dense piece (see :mod:`lctrain_kernels.docsplit`); None
            picks ``MIN_DENSE`` on CUDA, ``MIN_DENSE_CPU`` else.
        shape_steps: dense row counts per octave (0: exact document lengths).
        min_dense_share: below this share of the visible pairs in dense calls, the whole
            block runs on the masked backend.
    """

    name = "docsplit"

    def __init__(self, dense: str | None = None, masked: str | None = None, *,
                 min_dense: int | None = None, shape_steps: int = SHAPE_STEPS,
                 min_dense_share: float = MIN_DENSE_SHARE):
        self.dense, self.masked = dense, masked
        self.min_dense, self.shape_steps = min_dense, shape_steps
        self.min_dense_share = min_dense_share

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

    def plan(self, q: torch.Tensor, spec: MaskSpec, sk: int):
        """The :class:`~lctrain_kernels.docsplit.Split` this backend runs for a block."""
        min_dense = self.min_dense
        if min_dense is None:
            min_dense = MIN_DENSE if q.is_cuda else MIN_DENSE_CPU
        return split_block(spec, q.shape[1], sk, min_dense, self.shape_steps,
                           self.min_dense_share)

    def forward(self, q, k, v, spec: MaskSpec, relation: Relation, scale: float):
        plan = self.plan(q, spec, k.shape[1])
        dense, masked = self._inner(q)
        if not plan.dense:
            return masked.forward(q, k, v, spec, relation, scale)
        b, acc = q.shape[0], OutAcc(q.shape[1])
        for piece, rel, qr, kr in _dense_batches(plan, [q], [k, v]):
            out, lse = dense.forward(_rows(q, *qr), _rows(k, *kr), _rows(v, *kr), piece, rel,
                                     scale)  # (B*n, L, Hq, D), (B*n, Hq, L)
            acc.add(qr[0], _end(qr), _unbatch(out, b), _unbatch_lse(lse, b))
        for sub, rel, rows, keys in _masked_blocks(plan, spec):
            out, lse = masked.forward(q[:, rows], k[:, keys], v[:, keys], sub, rel, scale)
            acc.add(rows.start, rows.stop, out, lse)
        return acc.result(q)  # (B, Sq, Hq, D), (B, Hq, Sq)

    def backward(self, do, q, k, v, out, lse, spec: MaskSpec, relation: Relation, scale: float,
                 dlse=None):
        """Every piece covering a row gets that row's dlse: each moves only its own keys."""
        plan = self.plan(q, spec, k.shape[1])
        dense, masked = self._inner(q)
        if not plan.dense:
            return masked.backward(do, q, k, v, out, lse, spec, relation, scale, dlse)
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        dq, dk, dv = GradAcc(sq), GradAcc(sk), GradAcc(sk)
        for piece, rel, qr, kr in _dense_batches(plan, [do, q, out], [k, v]):
            g = dense.backward(_rows(do, *qr), _rows(q, *qr), _rows(k, *kr), _rows(v, *kr),
                               _rows(out, *qr), _rows_lse(lse, *qr), piece, rel, scale,
                               None if dlse is None else _rows_lse(dlse, *qr))
            dq.add(qr[0], _end(qr), _unbatch(g[0], b))
            dk.add(kr[0], _end(kr), _unbatch(g[1], b))
            dv.add(kr[0], _end(kr), _unbatch(g[2], b))
        for sub, rel, rows, keys in _masked_blocks(plan, spec):
            g = masked.backward(do[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                lse[:, :, rows], sub, rel, scale,
                                None if dlse is None else dlse[:, :, rows])
            dq.add(rows.start, rows.stop, g[0])
            dk.add(keys.start, keys.stop, g[1])
            dv.add(keys.start, keys.stop, g[2])
        return dq.result(q), dk.result(k), dv.result(v)
