"""The cudnn_ragged backend: masked blocks on cuDNN's ragged (THD) attention.

Each block is one or two ragged calls (:mod:`lctrain_kernels.ragged`), each document's piece a batch
entry cuDNN reads and writes in place through per-entry element offsets and lengths. The graphs are
built with ``nvidia-cudnn-frontend`` on the libcudnn torch loaded, and cached by what they are
compiled for, so a run's first steps build every plan it needs. cuDNN wants heads packed in each
token (any token stride in the forward, packed in the backward). Limits: compute capability 9.0+,
cuDNN 9.19+, fp16/bf16, head_dim a multiple of 8 up to 128."""
from __future__ import annotations

import torch

from lctrain_kernels.backends import BackendUnavailable, half_head_dim_reason
from lctrain_kernels.masks import MaskSpec, Relation
from lctrain_kernels.ragged import RaggedBackend, RaggedCall, bucket

MIN_CUDNN = 91900  # the oldest cuDNN tested (ragged statistics in both directions)

# Graph tensor uids.
_Q, _K, _V, _O, _STATS, _DO, _DQ, _DK, _DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
_LEN_Q, _LEN_K, _OFF_Q, _OFF_K, _OFF_V, _OFF_O, _OFF_STATS, _OFF_DK = range(10, 18)


def dotted_version(version: int) -> str:
    """cuDNN's version number (91900) as text (9.19.0)."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def _import_cudnn():
    try:
        import cudnn  # nvidia-cudnn-frontend
    except ImportError as exc:
        raise BackendUnavailable(
            "the cudnn_ragged backend needs the cuDNN frontend's Python package; install it "
            "with `pip install nvidia-cudnn-frontend`, or pick the triton backend.") from exc
    return cudnn


def _token_stride(x: torch.Tensor) -> int | None:
    """Elements between two tokens when rows flatten over the batch and each token's heads
    are packed ``(H, D)``; None when the layout is not like that."""
    b, s, h, d = x.shape
    if (x.stride(3) != 1 or (h > 1 and x.stride(2) != d)
            or (b > 1 and x.stride(0) != s * x.stride(1))):
        return None
    return x.stride(1)


def _compact(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its tokens packed (a copy for a head-group slice): cuDNN's ragged backward
    computed dK and dV wrong from inputs with a wider token stride than their gradients."""
    return x if x.stride(1) == x.shape[2] * x.shape[3] and _token_stride(x) else x.contiguous()


_KEY_SIDE = (_K, _V, _DK, _DV)


def _from_row(t: torch.Tensor, row: int) -> torch.Tensor:
    """The tensor from flattened row ``row`` on (a view; statistics are (rows, H) already)."""
    return t.view(-1, *t.shape[2:])[row:] if t.dim() == 4 else t[row:]


class _Graphs:
    """cuDNN graphs by what they are compiled for, built on first use."""

    def __init__(self, cudnn):
        self.cudnn = cudnn
        self.graphs: dict[tuple, tuple] = {}
        self.handles: dict[int, object] = {}

    def handle(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.handles:
            with torch.cuda.device(index):
                self.handles[index] = self.cudnn.create_handle()
        handle = self.handles[index]
        self.cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)
        return handle

    def get(self, key: tuple, device: torch.device):
        if key not in self.graphs:
            self.graphs[key] = self._build(key, self.handle(device))
        return self.graphs[key]

    def _build(self, key: tuple, handle):
        cudnn = self.cudnn
        (ragged, backward, causal, dtype, nb, sq, sk, hq, hkv, d, scale, tq, tk, tv,
         total_q, total_k, _) = key
        io = cudnn.data_type.HALF if dtype == torch.float16 else cudnn.data_type.BFLOAT16
        f32, i32, i64 = cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.INT64
        g = cudnn.pygraph(handle=handle, io_data_type=io, intermediate_data_type=f32,
                          compute_data_type=f32)

        def column(uid, name, n, dt):
            return g.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt, uid=uid)

        def rows(uid, name, heads, s, token_stride):
            return g.tensor(name=name, dim=[nb, heads, s, d], stride=[s * token_stride, d,
                            token_stride, 1], data_type=io, uid=uid)

        q = rows(_Q, "q", hq, sq, tq)
        k = rows(_K, "k", hkv, sk, tk)
        v = rows(_V, "v", hkv, sk, tv)
        mask = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                    diagonal_band_right_bound=0 if causal else None)
        offsets = {}
        if ragged:  # per-entry lengths and element offsets (a plain batch has neither)
            mask.update(use_padding_mask=True, seq_len_q=column(_LEN_Q, "len_q", nb, i32),
                        seq_len_kv=column(_LEN_K, "len_k", nb, i32))
            offsets = {uid: column(uid, f"off{uid}", nb + 1, i64)
                       for uid in (_OFF_Q, _OFF_K, _OFF_V, _OFF_O, _OFF_STATS, _OFF_DK)}
            for t, uid in ((q, _OFF_Q), (k, _OFF_K), (v, _OFF_V)):
                t.set_ragged_offset(offsets[uid])

        def ragged_at(t, uid):
            if ragged:
                t.set_ragged_offset(offsets[uid])
        out_stride = [sq * hq * d, d, hq * d, 1]
        stats_stride = [sq * hq, 1, hq, 1] if ragged else [hq * sq, sq, 1, 1]  # packed BHSD
        if not backward:
            o, stats = g.sdpa(name="fwd", q=q, k=k, v=v, generate_stats=True,
                              attn_scale=scale, **mask)
            o.set_uid(_O).set_output(True).set_dim([nb, hq, sq, d]).set_stride(out_stride) \
                .set_data_type(io)
            ragged_at(o, _OFF_O)
            stats.set_uid(_STATS).set_output(True).set_dim([nb, hq, sq, 1]) \
                .set_stride(stats_stride).set_data_type(f32)
            ragged_at(stats, _OFF_STATS)
        else:
            o = g.tensor(name="o", dim=[nb, hq, sq, d], stride=out_stride, data_type=io, uid=_O)
            do = g.tensor(name="do", dim=[nb, hq, sq, d], stride=out_stride, data_type=io, uid=_DO)
            stats = g.tensor(name="stats", dim=[nb, hq, sq, 1], stride=stats_stride,
                             data_type=f32, uid=_STATS)
            for t in (o, do):
                ragged_at(t, _OFF_O)
            ragged_at(stats, _OFF_STATS)
            if ragged:
                mask.update(max_total_seq_len_q=total_q, max_total_seq_len_kv=total_k)
            dq, dk, dv = g.sdpa_backward(name="bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                         attn_scale=scale, **mask)
            kv_stride = [sk * hkv * d, d, hkv * d, 1]
            dq.set_uid(_DQ).set_output(True).set_dim([nb, hq, sq, d]).set_stride(out_stride) \
                .set_data_type(io)
            ragged_at(dq, _OFF_O)
            for t, uid, in ((dk, _DK), (dv, _DV)):
                t.set_uid(uid).set_output(True).set_dim([nb, hkv, sk, d]) \
                    .set_stride(kv_stride).set_data_type(io)
                ragged_at(t, _OFF_DK)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g, g.get_workspace_size()


class CudnnEngine:
    """Runs one :class:`~lctrain_kernels.ragged.RaggedCall` on cuDNN (the Engine protocol)."""

    def __init__(self):
        self.graphs = _Graphs(_import_cudnn())
        self._columns: dict[tuple, tuple] = {}  # (call, device, shapes) -> device columns

    def _columns_for(self, call: RaggedCall, q, k, strides: tuple[int, int, int]) -> dict:
        """Lengths and element offsets of a call's entries on the device, by uid (``strides``:
        q's, k's, v's token strides); cached, as every layer runs the same blocks, and recorded
        on the current stream, so an entry dropped from the cache is not reused in flight."""
        hq, hkv, d = q.shape[2], k.shape[2], q.shape[3]
        key = (call, q.device, hq, hkv, d, strides)
        if key not in self._columns:
            q_rows, k_rows, q_lens, k_lens = call.padded()
            lens = torch.tensor([q_lens, k_lens], dtype=torch.int32)
            q_rows, k_rows = torch.tensor(q_rows), torch.tensor(k_rows)  # int64
            offsets = torch.stack([q_rows * strides[0], k_rows * strides[1],
                                   k_rows * strides[2], q_rows * (hq * d), q_rows * hq,
                                   k_rows * (hkv * d)])
            lens, offsets = lens.to(q.device), offsets.to(q.device)
            if len(self._columns) >= 256:
                self._columns.pop(next(iter(self._columns)))
            self._columns[key] = (lens, offsets, dict(zip(
                (_LEN_Q, _LEN_K, _OFF_Q, _OFF_K, _OFF_V, _OFF_O, _OFF_STATS, _OFF_DK),
                (*lens.unbind(), *offsets.unbind()))))
        lens, offsets, columns = self._columns[key]
        stream = torch.cuda.current_stream(q.device)
        lens.record_stream(stream)
        offsets.record_stream(stream)
        return columns

    def _run(self, backward: bool, call: RaggedCall, scale: float, pack: dict) -> None:
        q, k, v = pack[_Q], pack[_K], pack[_V]
        total_q, total_k = q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]
        strides = (_token_stride(q), _token_stride(k), _token_stride(v))
        if call.uniform:  # a plain batch from the first rows on: cuDNN's dense kernel
            pack = {uid: _from_row(t, call.k_rows[0] if uid in _KEY_SIDE else call.q_rows[0])
                    for uid, t in pack.items()}
            shape = (call.entries, call.q_lens[0], call.k_lens[0], 0, 0)
            lse_t = pack[_STATS][:shape[0] * shape[1]].view(shape[0], shape[1], -1)
            pack[_STATS] = lse_t.transpose(1, 2).contiguous()  # cuDNN's dense stats layout
        else:
            pack.update(self._columns_for(call, q, k, strides))
            shape = (bucket(call.entries), call.max_q, call.max_k, -(-total_q // 64) * 64,
                     -(-total_k // 64) * 64)
        nb, sq, sk, tot_q, tot_k = shape
        key = (not call.uniform, backward, call.causal, q.dtype, nb, sq, sk, q.shape[2],
               k.shape[2], q.shape[3], float(scale), *strides, tot_q, tot_k, q.device)
        graph, size = self.graphs.get(key, q.device)
        workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=q.device)
        graph.execute(pack, workspace, handle=self.graphs.handle(q.device))
        if call.uniform and not backward:
            lse_t.copy_(pack[_STATS].transpose(1, 2))

    def forward(self, call, q, k, v, out, lse_t, scale):
        self._run(False, call, scale, {_Q: q, _K: k, _V: v, _O: out, _STATS: lse_t})

    def backward(self, call, do, q, k, v, out, lse_t, dq, dk, dv, scale):
        self._run(True, call, scale, {_Q: q, _K: k, _V: v, _O: out, _DO: do, _STATS: lse_t,
                                      _DQ: dq, _DK: dk, _DV: dv})


_ENGINE: list[CudnnEngine] = []  # the process's one engine (every lookup builds a backend)


class CudnnRaggedBackend(RaggedBackend):
    """cuDNN's ragged attention: every relation, documents as in-place batch entries."""

    name = "cudnn_ragged"

    def __init__(self):
        if not torch.cuda.is_available():
            raise BackendUnavailable("the cudnn_ragged backend needs a CUDA GPU and none is "
                                     "visible; use backend='reference' (or 'auto').")
        if not _ENGINE:
            _ENGINE.append(CudnnEngine())
        super().__init__(_ENGINE[0])

    def setup_reason(self, device: torch.device) -> str | None:
        """:meth:`RaggedBackend.setup_reason`, and cuDNN new enough."""
        reason = super().setup_reason(device)
        if reason is not None:
            return reason
        version = self.engine.graphs.cudnn.backend_version()
        if version < MIN_CUDNN:
            return (f"the cudnn_ragged backend is tested with cuDNN {dotted_version(MIN_CUDNN)} or "
                    f"newer, and torch loaded cuDNN {dotted_version(version)}; use triton.")
        return None

    def unsupported(self, q, k, v, spec: MaskSpec, relation: Relation) -> str | None:
        return self.setup_reason(q.device) or half_head_dim_reason(self.name, q, 128)

    def forward(self, q, k, v, spec, relation, scale):
        q, k, v = (x if _token_stride(x) is not None else x.contiguous() for x in (q, k, v))
        return super().forward(q, k, v, spec, relation, scale)

    def grads(self, do, q, k, v, out, lse, spec, relation, scale):
        q, k, v = _compact(q), _compact(k), _compact(v)
        return super().grads(do, q, k, v, out, lse, spec, relation, scale)
