"""The flash_attn_cute backend: FlashAttention 4's CuTe kernels for every block, dense or not.

FlashAttention 4 (``flash-attn-4``, in NVIDIA's CuTe DSL) runs varlen batches: entry ``b`` starts at
row ``cu_seqlens[b]`` and is ``seqused[b]`` rows long, so every piece of a block
(:mod:`lctrain_kernels.ragged`) is read and written where it lies. Its causal mask is aligned to the
bottom-right corner of an entry, lctrain's pieces are top-left triangles: they agree on square
entries, and a piece with more query rows than keys is the local mask ``j <= i + (sk - sq) + right``
with ``right = sq - sk``. So a causal call runs as one causal launch for its square entries and one
windowed launch per other shape (:func:`launches`). Limits: compute capability 9.0+, fp16/bf16,
head_dim a multiple of 8 up to 256."""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass

import torch

from lctrain_kernels.backends import BackendUnavailable, half_head_dim_reason
from lctrain_kernels.masks import MaskSpec, Relation
from lctrain_kernels.ragged import RaggedBackend, RaggedCall


def _load():
    try:
        from flash_attn.cute import interface
    except ImportError as exc:
        raise BackendUnavailable(
            "the flash_attn_cute backend needs FlashAttention 4; install it with `pip install "
            "'lctrain[fa4]'` (flash-attn-4 and NVIDIA's CUTLASS DSL), or pick cudnn or "
            "cudnn_ragged.") from exc
    return interface._flash_attn_fwd, interface._flash_attn_bwd


_UNTRACED = re.compile(r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument")


@contextlib.contextmanager
def quiet_dsl():
    """Drop the CuTe DSL's "Argument aux_data ... cannot be converted to a JitArgument" warnings
    (dozens a run, about an argument the kernels never read); every other warning is shown."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not (issubclass(category, UserWarning) and _UNTRACED.match(str(message))):
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


@dataclass(frozen=True)
class Launch:
    """One kernel launch: entries (rows flattened over the batch) that share a mask rule,
    all visible, causal from the bottom-right corner, or with the right window ``right``."""

    causal: bool
    right: int | None
    q_rows: tuple[int, ...]
    k_rows: tuple[int, ...]
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]


def launches(call: RaggedCall) -> tuple[Launch, ...]:
    """The launches that run ``call`` with FlashAttention's masks (module docstring)."""
    entries = list(zip(call.q_rows, call.k_rows, call.q_lens, call.k_lens))
    if not call.causal:
        return (Launch(False, None, *zip(*entries)),)
    by_shape: dict[int, list] = {}
    for entry in entries:
        by_shape.setdefault(entry[2] - entry[3], []).append(entry)
    return tuple(Launch(extra == 0, None if extra == 0 else extra, *zip(*group))
                 for extra, group in sorted(by_shape.items()))


MIN_MAX_SEQLEN = 257
"""The least ``max_seqlen`` a launch tells FlashAttention 4: more than one tile of any of its
kernels (tiles are at most 256 rows). It compiles a separate backward for a launch whose longest
entry fits one tile, and where documents fall decides which launches those are: without the floor
a run compiles new kernels at random steps, seconds each. An entry shorter than the bound only adds
tiles that find no rows and end at once."""


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B * S, H, D), a view where the layout allows."""
    return x.reshape(-1, *x.shape[2:])


class CuteEngine:
    """Runs one :class:`~lctrain_kernels.ragged.RaggedCall` on FlashAttention 4 (ragged.Engine)."""

    def __init__(self, fwd, bwd):
        self._fwd, self._bwd = fwd, bwd
        self._columns: dict[tuple, tuple[list, dict]] = {}  # (launch, device) -> columns

    def _args(self, launch: Launch, device: torch.device) -> dict:
        """Offsets, lengths and mask arguments of a launch (cached: every layer runs them)."""
        key = (launch, device)
        if key not in self._columns:
            ends = [r + n for r, n in zip(launch.q_rows, launch.q_lens)]
            k_ends = [r + n for r, n in zip(launch.k_rows, launch.k_lens)]
            cols = [torch.tensor(c, dtype=torch.int32).to(device) for c in (
                (*launch.q_rows, max(ends)), (*launch.k_rows, max(k_ends)), launch.q_lens,
                launch.k_lens)]
            mask = ({"causal": launch.causal} if launch.right is None else
                    {"causal": False, "window_size_left": None,
                     "window_size_right": launch.right})
            if len(self._columns) >= 256:
                self._columns.pop(next(iter(self._columns)))
            self._columns[key] = (cols, dict(
                cu_seqlens_q=cols[0], cu_seqlens_k=cols[1], seqused_q=cols[2],
                seqused_k=cols[3], max_seqlen_q=max(*launch.q_lens, MIN_MAX_SEQLEN),
                max_seqlen_k=max(*launch.k_lens, MIN_MAX_SEQLEN), **mask))
        cols, args = self._columns[key]
        for col in cols:  # an entry dropped from the cache is not reused while a kernel reads it
            if col.is_cuda:
                col.record_stream(torch.cuda.current_stream(device))
        return args

    def forward(self, call, q, k, v, out, lse_t, scale):
        qf, kf, vf, of = _flat(q), _flat(k), _flat(v), out.view(-1, *out.shape[2:])
        lse_h = lse_t.t().contiguous()  # (Hq, T): rows of other calls keep their values
        with quiet_dsl():
            for launch in launches(call):
                self._fwd(qf, kf, vf, softmax_scale=scale, out=of, lse=lse_h, return_lse=True,
                          **self._args(launch, q.device))
        lse_t.copy_(lse_h.t())

    def backward(self, call, do, q, k, v, out, lse_t, dq, dk, dv, scale):
        lse_h = lse_t.t().contiguous()
        flat = [_flat(x) for x in (q, k, v, out, do)]
        grads = [x.view(-1, *x.shape[2:]) for x in (dq, dk, dv)]
        with quiet_dsl():
            for launch in launches(call):
                self._bwd(*flat, lse_h, softmax_scale=scale, dq=grads[0], dk=grads[1],
                          dv=grads[2], **self._args(launch, q.device))


_ENGINE: list[CuteEngine] = []


class FlashAttnCuteBackend(RaggedBackend):
    """FlashAttention 4: every relation, pieces as in-place varlen entries."""

    name = "flash_attn_cute"

    def __init__(self):
        if not _ENGINE:
            _ENGINE.append(CuteEngine(*_load()))
        super().__init__(_ENGINE[0])

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        return self.setup_reason(q.device) or half_head_dim_reason(self.name, q, 256)
