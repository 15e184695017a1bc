"""Distributed attention benchmark: lctrain's schedules next to torch's context_parallel.

``run`` launches ``nproc`` processes itself (NCCL on GPUs, one per GPU; gloo on a CPU), then:

1. checks every schedule (and the no-overlap ablation) at a small length against the float32
   reference on the whole sequence, next to the single-device kernel's own error on the same
   inputs: a schedule is ``correct`` when it errs at most twice as much as that kernel;
2. for each total sequence length, times forward and backward separately (CUDA events on
   every rank, warm-up, then the median of ``repeats``; the slowest rank's median is reported)
   for each schedule, distflash without overlap, the peers (torch context_parallel on cuDNN,
   ring-flash-attn if installed) and the single-GPU kernel at the same total length;
3. reports per-GPU TFLOP/s with the FLOP model of shared/PERF.md (causal forward 2·S²·H·D for
   the WHOLE sequence, divided by the number of GPUs; backward 2.5× forward), the ratio to the
   single-GPU rate (``vs_single``), each schedule's balance figure (max/mean causal work per
   rank) and, for distflash, the share of its communication hidden behind compute:
   (t_no_overlap − t_overlap) / t_comm_only, where t_comm_only moves the same messages with no
   compute at all.

A ``time_budget_s`` skips (with that status) measurements whose estimated time would overrun.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lctrain.bench.attention_peers import PEERS, PeerUnavailable, Shape
from lctrain.bench.kernel import forward_flops
from lctrain.bench.result import BenchResult
from lctrain_kernels.distributed.comm import nccl_options
from lctrain_kernels.vocabulary import SCHEDULES, check_schedule, check_seq_len

_MAX_REPEATS = 50


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run measures (plain values: it travels to the spawned ranks)."""

    seq_lens: tuple[int, ...]
    schedules: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    overlap_ablation: bool
    peers: bool
    backend: str
    repeats: int
    warmup: int
    check_len: int
    single_max_len: int
    time_budget_s: float | None
    min_time_s: float = 0.0


def _timings(fwd, bwd, device: torch.device, repeats: int, warmup: int):
    """Per-iteration forward and backward milliseconds (CUDA events, or the host clock)."""
    for _ in range(warmup):
        bwd(fwd())
    if device.type != "cuda":
        fw, bw = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state = fwd()
            t1 = time.perf_counter()
            bwd(state)
            fw.append((t1 - t0) * 1e3)
            bw.append((time.perf_counter() - t1) * 1e3)
        return fw, bw
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(repeats)]
    for e0, e1, e2 in events:
        e0.record()
        state = fwd()
        e1.record()
        bwd(state)
        e2.record()
    torch.cuda.synchronize(device)
    return [a.elapsed_time(b) for a, b, _ in events], [b.elapsed_time(c) for _, b, c in events]


class _Bench:
    """The work of one rank; rank 0 assembles the rows."""

    def __init__(self, cfg: BenchConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype = getattr(torch, cfg.dtype)
        self.start, self.rate = time.perf_counter(), 250e12 if device.type == "cuda" else 1e9
        self.single_backend = "cudnn" if device.type == "cuda" and cfg.backend == "auto" else (
            "reference" if cfg.backend == "auto" else cfg.backend)

    def _agree(self, value):
        """Rank 0's value on every rank (decisions must match, or the ranks would hang)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _affordable(self, flops_per_gpu: float) -> bool:
        if self.cfg.time_budget_s is None:
            return True
        est = (self.cfg.warmup + self.cfg.repeats) * 3.5 * flops_per_gpu / self.rate
        return self._agree(time.perf_counter() - self.start + est <= self.cfg.time_budget_s)

    def _repeats(self, flops_per_gpu: float) -> int:
        """Timed iterations: at least ``repeats``, more until about ``min_time_s`` of timing
        (short lengths are noisy), at most 50. The estimate uses the last measured rate, which
        every rank holds alike (it comes from all-gathered timings), so ranks agree."""
        c = self.cfg
        if not c.min_time_s:
            return c.repeats
        per_iteration = 3.5 * flops_per_gpu / self.rate
        return int(min(_MAX_REPEATS, max(c.repeats, math.ceil(c.min_time_s / per_iteration))))

    def _local(self, n: int, heads: int, seed: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(seed * 1000 + self.rank)
        return torch.randn((1, n, heads, self.cfg.head_dim), generator=gen, dtype=self.dtype,
                           device=self.device)  # (1, n, H, D)

    def _ours(self, seq_len: int, schedule: str, overlap: bool):
        """(fwd, bwd) closures of lctrain's op on random local rows."""
        n, c = seq_len // self.world, self.cfg
        q, k, v, do = (self._local(n, h, s) for s, h in enumerate((c.heads, c.kv_heads, c.kv_heads, c.heads)))
        opts = (self.group.group_name, True, [], c.head_dim ** -0.5, schedule, c.backend, overlap)
        fwd = lambda: torch.ops.lctrain.dist_attention(q, k, v, *opts)  # noqa: E731
        bwd = lambda o: torch.ops.lctrain.dist_attention_backward(do, q, k, v, o[0], o[1], *opts)  # noqa: E731
        return fwd, bwd

    def _comm_only_ms(self, seq_len: int, schedule: str) -> float:
        """Median milliseconds of the forward + backward messages of a schedule, no compute."""
        from lctrain_kernels.distributed.comm import Exchanger
        from lctrain_kernels.distributed.executor import BackwardEngine, ForwardEngine, Geometry, pruned_plan
        from lctrain_kernels.distributed.schedule import make_schedule

        n, c = seq_len // self.world, self.cfg
        q, k = self._local(n, c.heads, 0), self._local(n, c.kv_heads, 1)
        lse = torch.zeros((1, c.heads, n), dtype=torch.float32, device=self.device)
        geo = Geometry(seq_len, self.world, make_schedule(self.world, schedule).layout, True, None)
        exch = Exchanger(self.group)
        fwd = lambda: ForwardEngine(pruned_plan(schedule, "forward", geo), geo, exch, False, q, k, k,  # noqa: E731
                                    1.0, c.backend, compute=False).run()
        bwd = lambda _: BackwardEngine(pruned_plan(schedule, "backward", geo), geo, exch, False, q, q,  # noqa: E731
                                       k, k, q, lse, 1.0, c.backend, compute=False).run()
        fw, bw = _timings(fwd, bwd, self.device, c.repeats, 1)
        return statistics.median(a + b for a, b in zip(fw, bw))

    def _time(self, make, flops_per_gpu: float, peer: bool) -> dict:
        """Time (fwd, bwd) from ``make()`` on every rank; the slowest rank's medians.

        A peer that fails (unavailable, unsupported shape) gives a status instead of a number;
        lctrain's own schedules are allowed to fail only for memory, anything else is a bug.
        """
        status, fw, bw = "ok", [], []
        caught = Exception if peer else (PeerUnavailable, torch.cuda.OutOfMemoryError)
        repeats = self._repeats(flops_per_gpu)
        try:
            with make() as (fwd, bwd):
                fw, bw = _timings(fwd, bwd, self.device, repeats, self.cfg.warmup)
        except caught as exc:
            status = f"{'' if isinstance(exc, PeerUnavailable) else type(exc).__name__ + ': '}{exc}"
            status = status.splitlines()[0][:200]
        per_rank = [None] * self.world
        dist.all_gather_object(per_rank, (status, fw, bw), group=self.group)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        bad = [s for s, _, _ in per_rank if s != "ok"]
        if bad:
            return {"status": bad[0]}
        f = max(statistics.median(x) for _, x, _ in per_rank)
        b = max(statistics.median(y) for _, _, y in per_rank)
        tot = max(statistics.median(x + y for x, y in zip(xs, ys)) for _, xs, ys in per_rank)
        self.rate = 3.5 * flops_per_gpu / tot * 1e3
        return {"fwd_ms": f, "bwd_ms": b, "total_ms": tot, "repeats": repeats,
                "total_ms_min": min(min(x + y for x, y in zip(xs, ys)) for _, xs, ys in per_rank),
                "total_ms_max": max(max(x + y for x, y in zip(xs, ys)) for _, xs, ys in per_rank),
                "fwd_tflops": flops_per_gpu / f / 1e9, "bwd_tflops": 2.5 * flops_per_gpu / b / 1e9,
                "total_tflops": 3.5 * flops_per_gpu / tot / 1e9, "status": "ok"}

    def _single(self, seq_len: int) -> dict:
        """The single-device kernel at the same TOTAL length, on every GPU at once; rank 0's."""
        from lctrain.bench.kernel import run as kernel_run

        c = self.cfg
        repeats = self._repeats(forward_flops(seq_len, c.heads, c.head_dim, True, None))
        res = kernel_run([seq_len], backends=[self.single_backend], heads=c.heads, head_dim=c.head_dim,
                         dtype=self.dtype, causal=True, kv_heads=c.kv_heads, repeats=repeats,
                         warmup=c.warmup, check_len=min(256, seq_len), device=self.device).rows[0]
        keys = ("fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "total_tflops", "status")
        row = {key: res.get(key) for key in keys}
        row["repeats"] = repeats
        if row.get("fwd_ms") is not None:
            row["total_ms"] = row["fwd_ms"] + row["bwd_ms"]
        return self._agree(row)

    def variants(self) -> list[tuple[str, str | None, bool]]:
        """(row name, schedule or peer, overlap), in the order they are measured."""
        c, out = self.cfg, []
        for s in c.schedules:
            out.append((s, s, True))
            if s == "distflash" and c.peers:
                out += [(p, p, True) for p in PEERS]
        if "distflash" in c.schedules and c.overlap_ablation:
            out.append(("distflash (no overlap)", "distflash", False))
        return out

    def run(self) -> list[dict]:
        """Correctness gate, then every length: single GPU, every variant, the hidden share."""
        from lctrain.bench.attention_check import check_schedules

        checks = check_schedules(self.group, self.device, self.dtype, self.cfg, self.variants())
        rows = []
        for seq_len in self.cfg.seq_lens:
            rows += self._length(seq_len, checks)
            self._hidden_share(rows, seq_len)
        return rows

    def _length(self, seq_len: int, checks: dict) -> list[dict]:
        from lctrain_kernels.distributed import make_schedule

        c = self.cfg
        flops = forward_flops(seq_len, c.heads, c.head_dim, True, None)  # whole sequence
        base = {"seq_len": seq_len, "gpus": self.world, "tokens_per_gpu": seq_len // self.world}
        single = {"status": f"skipped: longer than single_max_len {c.single_max_len}"}
        if seq_len <= c.single_max_len:
            single = self._single(seq_len) if self._affordable(flops) else {"status": "skipped: time budget"}
        rows = [{**base, "variant": f"single-gpu {self.single_backend}", "gpus": 1, **single}]
        for name, what, overlap in self.variants():
            balance = make_schedule(self.world, what).balance() if what in SCHEDULES else None
            row = {**base, "variant": name, "balance": balance}
            if not self._affordable(flops / self.world * (balance or 1.0)):
                rows.append({**row, "status": "skipped: time budget"})
                continue
            if what in PEERS:
                spec = Shape(seq_len, c.heads, c.kv_heads, c.head_dim, self.dtype, self.device)
                make = lambda: PEERS[what](self.group, spec)  # noqa: E731
            else:
                make = lambda: contextlib.nullcontext(self._ours(seq_len, what, overlap))  # noqa: E731
            row.update(self._time(make, flops / self.world, what in PEERS), **checks.get(name, {}))
            if single.get("total_tflops") and row.get("total_tflops"):
                row["vs_single"] = row["total_tflops"] / single["total_tflops"]
            rows.append(row)
        return rows

    def _hidden_share(self, rows: list[dict], seq_len: int) -> None:
        get = {r["variant"]: r for r in rows if r["seq_len"] == seq_len and r.get("status") == "ok"}
        on, off = get.get("distflash"), get.get("distflash (no overlap)")
        if on is None or off is None:
            return
        comm = self._agree(self._comm_only_ms(seq_len, "distflash"))
        on["comm_only_ms"] = comm
        hidden = (off["total_ms"] - on["total_ms"]) / comm if comm > 0 else None
        on["hidden_share"] = None if hidden is None else min(1.0, max(0.0, hidden))


def _worker(rank: int, world: int, cfg: BenchConfig, tmp: str) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    kwargs = dict(backend="nccl" if cuda else "gloo", init_method="file://" + os.path.join(tmp, "store"),
                  rank=rank, world_size=world, timeout=timedelta(seconds=300))
    if cuda:
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # eager NCCL init: batched P2P needs a ready communicator
        kwargs["pg_options"] = nccl_options(kwargs["timeout"])  # high-priority NCCL streams
    else:
        torch.set_num_threads(1)
    dist.init_process_group(**kwargs)
    try:
        rows = _Bench(cfg, device).run()
        if rank == 0:
            with open(os.path.join(tmp, "rows.json"), "w") as f:
                json.dump(rows, f)
        # Every rank's last transfers finish before any tears the group down (gloo aborted a
        # rank once when its peer destroyed the group while its last message was in flight).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(seq_lens: list[int], schedules: list[str] | None = None, nproc: int | None = None, heads: int = 32,
        kv_heads: int | None = None, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
        overlap_ablation: bool = True, peers: bool = True, backend: str = "auto", *, repeats: int = 5,
        warmup: int = 2, check_len: int | None = None, single_max_len: int = 262144,
        time_budget_s: float | None = None, min_time_s: float = 0.0) -> BenchResult:
    """Benchmark distributed attention on ``nproc`` ranks it launches itself.

    Args:
        seq_lens: TOTAL sequence lengths (batch 1); each must split into 2·nproc chunks.
        schedules: lctrain schedules to time (default all: distflash, ring, zigzag).
        nproc: ranks; default every CUDA GPU, or 2 CPU processes (gloo) without one.
        heads, kv_heads, head_dim: attention shape (kv_heads default = heads).
        dtype: input dtype.
        overlap_ablation: also time distflash with overlap=False (and the hidden share).
        peers: also time torch context_parallel and ring-flash-attn where they can run.
        backend: local attention backend of lctrain's schedules ("auto": cuDNN on a GPU).
        repeats: timed iterations per measurement (median reported; ≥ 5 for figures).
        warmup: untimed iterations first.
        check_len: total length of the correctness check (default min(seq_lens, 2048·nproc)).
        single_max_len: longest total length timed on a single GPU.
        time_budget_s: skip measurements that would end later than this after the start.
        min_time_s: time more than ``repeats`` iterations where one is short, until about this
            many seconds per measurement (at most 50 iterations); 0 keeps ``repeats``.

    Returns:
        A :class:`BenchResult`, one row per (seq_len, variant).

    Raises:
        ValueError: bad sizes or names (one sentence each).
    """
    cuda = torch.cuda.is_available()
    nproc = nproc or (torch.cuda.device_count() if cuda else 2)
    kv_heads = kv_heads or heads
    schedules = tuple(schedules or SCHEDULES)
    for s in schedules:
        check_schedule(s)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}).")
    if cuda and nproc > torch.cuda.device_count():
        raise ValueError(f"nproc {nproc} exceeds the {torch.cuda.device_count()} visible GPUs.")
    check_len = check_len or min(min(seq_lens), 2048 * nproc)
    for s in (*seq_lens, check_len):
        check_seq_len(s, nproc, "zigzag", ranks=f"{nproc} ranks")  # every schedule and peer
    cfg = BenchConfig(tuple(seq_lens), schedules, heads, kv_heads, head_dim, str(dtype).replace("torch.", ""),
                      overlap_ablation, peers, backend, repeats, warmup, check_len, single_max_len, time_budget_s,
                      min_time_s)
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(nproc, cfg, tmp), nprocs=nproc, join=True)
        with open(os.path.join(tmp, "rows.json")) as f:
            rows = json.load(f)
    meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
            "nproc": nproc, **{k: v for k, v in asdict(cfg).items() if k != "seq_lens"},
            "flop_model": "causal fwd 2*S^2*H*D of the whole sequence / GPUs; bwd 2.5x fwd"}
    columns = ["seq_len", "variant", "gpus", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "total_tflops",
               "vs_single", "balance", "hidden_share", "max_rel_err", "correct", "status"]
    return BenchResult(title=f"distributed attention ({nproc} ranks, per-GPU TFLOP/s)", rows=rows, meta=meta,
                       columns=columns, x="seq_len", y="total_tflops", series="variant")


__all__ = ["BenchConfig", "run"]
