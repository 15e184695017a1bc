"""Distributed attention benchmark: lctrain's schedules next to torch's context_parallel.

``run`` launches ``nproc`` processes itself (NCCL on GPUs, gloo on a CPU), checks every schedule at
a small length against the float32 reference (`lctrain.bench.attention_compare`), then per total
length times forward and backward (the slowest rank's median) of each schedule, distflash without
overlap, the peers and the single-GPU kernel. It reports per-GPU TFLOP/s, ``vs_single``, each
schedule's balance (max/mean causal work per rank) and distflash's hidden share of communication,
(t_no_overlap − t_overlap) / t_comm_only. With ``documents`` every length is packed documents;
the peers, which take no document mask, say so."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from lctrain.bench.attention_compare import PEERS, PeerUnavailable, check_schedules
from lctrain.bench.documents import Documents, parse_each
from lctrain.model.flops import BACKWARD_FACTOR, MODEL, attention_flops, rates
from lctrain.bench.result import BenchResult
from lctrain.bench.timing import measure, profile, repeats_for
from lctrain.bench.views import progress_line
from lctrain.errors import ConfigError
from lctrain.report.versions import environment
from lctrain_kernels.api import BackendUnavailable, Relation, auto_order, get_backend
from lctrain_kernels.distributed import (balanced_order, make_schedule, messages_only, nccl_options,
                                         work_balance)
from lctrain_kernels.vocabulary import SCHEDULES, check_schedule, check_seq_len

DEFAULTS = {  # per device type: what a run with no sizes measures
    "cuda": {"seq_lens": (65536, 131072, 262144), "heads": 32, "head_dim": 128,
             "dtype": "bfloat16"},
    "cpu": {"seq_lens": (256, 512), "heads": 4, "head_dim": 32, "dtype": "float32"},
}
_ITERATION = 1 + BACKWARD_FACTOR  # forward + backward, in units of forward FLOPs
_NOT_META = ("seq_lens", "progress", "documents", "check_documents")  # meta says them in words


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
    min_time_s: float = 0.0
    profile_dir: str | None = None
    progress: Callable[[str], None] | None = None
    documents: dict[int, Documents] | None = None  # per total length
    check_documents: Documents | None = None  # the mix scaled to check_len
    balance_documents: bool = True  # lctrain's schedules get the documents in balanced order

    def bounds(self, seq_len: int, schedule: str | None = None,
               world: int = 1) -> tuple[int, ...] | None:
        """Document bounds at ``seq_len`` (None: one sequence); for lctrain's ``schedule`` over
        ``world`` ranks in the order training gives them, when ``balance_documents``."""
        if self.documents is None:
            return None
        bounds = self.documents[seq_len].cu_seqlens
        if not self.balance_documents or schedule not in SCHEDULES or world == 1:
            return bounds
        lengths = np.diff(bounds)
        order = balanced_order(lengths, seq_len, world, schedule)
        return tuple(int(x) for x in np.cumsum([0, *lengths[list(order)]]))

    def balance(self, seq_len: int, schedule: str, world: int) -> float:
        """The busiest rank's attention work over the mean under ``schedule``: for one causal
        sequence the schedule's own figure, with documents theirs (in the order timed)."""
        bounds = self.bounds(seq_len, schedule, world)
        if bounds is None:
            return make_schedule(world, schedule).balance()
        return work_balance(np.diff(bounds), seq_len, world, schedule)


class _Bench:
    """The work of one rank; rank 0 assembles the rows."""

    def __init__(self, cfg: BenchConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.group = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dtype = getattr(torch, cfg.dtype)
        self.rate = 250e12 if device.type == "cuda" else 1e9  # FLOP/s until one is measured
        self.single_backend = _single_backend(cfg.backend, device, self.dtype,
                                              cfg.documents is not None)

    def _agree(self, value):
        """Rank 0's value on every rank (decisions must match, or the ranks would hang)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _say(self, line: str) -> None:
        if self.rank == 0 and self.cfg.progress is not None:
            self.cfg.progress(line)

    def _repeats(self, flops_per_gpu: float) -> int:
        """`repeats_for` at the last measured rate, which every rank holds alike (it comes
        from all-gathered timings), so the ranks agree."""
        estimate_ms = _ITERATION * flops_per_gpu / self.rate * 1e3
        return repeats_for(estimate_ms, self.cfg.repeats, self.cfg.min_time_s)

    def _local(self, n: int, heads: int, seed: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(seed * 1000 + self.rank)
        return torch.randn((1, n, heads, self.cfg.head_dim), generator=gen, dtype=self.dtype,
                           device=self.device)  # (1, n, H, D)

    @contextlib.contextmanager
    def _ours(self, seq_len: int, schedule: str, overlap: bool):
        """(fwd, bwd) closures of lctrain's op on random local rows, as a peer gives them."""
        n, c = seq_len // self.world, self.cfg
        q, k, v, do = (self._local(n, h, s) for s, h in enumerate((c.heads, c.kv_heads, c.kv_heads, c.heads)))
        bounds = list(c.bounds(seq_len, schedule, self.world) or [])
        opts = (self.group.group_name, True, bounds, c.head_dim ** -0.5, schedule, c.backend, overlap)
        fwd = lambda: torch.ops.lctrain.dist_attention(q, k, v, *opts)  # noqa: E731
        bwd = lambda o: torch.ops.lctrain.dist_attention_backward(do, q, k, v, o[0], o[1], *opts)  # noqa: E731
        yield fwd, bwd

    def _comm_only_ms(self, seq_len: int, schedule: str) -> float:
        """Median milliseconds of the forward + backward messages of a schedule, no compute."""
        n, c = seq_len // self.world, self.cfg
        q, k = self._local(n, c.heads, 0), self._local(n, c.kv_heads, 1)
        bounds = c.bounds(seq_len, schedule, self.world)
        fwd = lambda: messages_only("forward", q, k, self.group, schedule, bounds)  # noqa: E731
        bwd = lambda _: messages_only("backward", q, k, self.group, schedule, bounds)  # noqa: E731
        return measure(fwd, bwd, device=self.device, repeats=c.repeats, warmup=1).summary()["total_ms"]

    def _time(self, make, flops_per_gpu: float, peer: bool, trace: str | None) -> dict:
        """Time (fwd, bwd) from ``make()`` on every rank; the slowest rank's medians. A failed
        peer gives a status; lctrain's schedules may fail only for memory (else it is a bug).
        With ``trace`` (lctrain's schedules only) a profile follows the timing."""
        status, times, prof = "ok", None, {}
        caught = Exception if peer else (PeerUnavailable, torch.cuda.OutOfMemoryError)
        repeats = self._repeats(flops_per_gpu)
        try:
            with make() as (fwd, bwd):
                times = measure(fwd, bwd, device=self.device, repeats=repeats,
                                warmup=self.cfg.warmup).summary()
                if trace is not None:
                    prof = profile(fwd, bwd, self.device, trace.format(rank=self.rank),
                                   sync=lambda: dist.barrier(group=self.group))
        except caught as exc:
            status = f"{'' if isinstance(exc, PeerUnavailable) else type(exc).__name__ + ': '}{exc}"
            status = status.splitlines()[0][:200]
        per_rank = [None] * self.world
        dist.all_gather_object(per_rank, (status, times), group=self.group)
        torch.cuda.empty_cache()  # a no-op where CUDA was never used
        if bad := [s for s, _ in per_rank if s != "ok"]:
            return {"status": bad[0]}
        row = {key: max(t[key] for _, t in per_rank) for key in ("fwd_ms", "bwd_ms", "total_ms")}
        self.rate = _ITERATION * flops_per_gpu / row["total_ms"] * 1e3
        return {**row, "repeats": repeats,
                "total_ms_min": min(t["total_ms_min"] for _, t in per_rank),
                "total_ms_max": max(t["total_ms_max"] for _, t in per_rank),
                **rates(flops_per_gpu, row["fwd_ms"], row["bwd_ms"]), **prof, "status": "ok"}

    def _single(self, seq_len: int) -> dict:
        """The single-device kernel at the same TOTAL length, on every GPU at once; rank 0's."""
        from lctrain.bench.kernel import run as kernel_run

        c = self.cfg
        repeats = self._repeats(attention_flops(seq_len, c.heads, c.head_dim, True, c.bounds(seq_len)))
        docs = None if c.documents is None else {seq_len: c.documents[seq_len]}
        res = kernel_run([seq_len], backends=[self.single_backend], heads=c.heads, head_dim=c.head_dim,
                         dtype=self.dtype, causal=True, documents=docs, kv_heads=c.kv_heads,
                         dense_reference=None, repeats=repeats, warmup=c.warmup,
                         check_len=min(256, seq_len), device=self.device).rows[0]
        keys = ("fwd_ms", "bwd_ms", "total_ms", "fwd_tflops", "bwd_tflops", "total_tflops", "status")
        return self._agree({**{key: res.get(key) for key in keys}, "repeats": repeats})

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
        checks = check_schedules(self.group, self.device, self.dtype, self.cfg, self.variants())
        for name, check in checks.items():
            self._say(f"{name}: error {check['max_rel_err']:.1e} at {self.cfg.check_len} tokens "
                      f"(one device: {check['single_rel_err']:.1e}) — "
                      f"{'correct' if check['correct'] else 'INCORRECT'}")
        rows = []
        for seq_len in self.cfg.seq_lens:
            rows += self._length(seq_len, checks)
            self._hidden_share(rows, seq_len)
        return rows

    def _length(self, seq_len: int, checks: dict) -> list[dict]:
        c = self.cfg
        flops = attention_flops(seq_len, c.heads, c.head_dim, True, c.bounds(seq_len))  # all of it
        base = {"seq_len": seq_len, "gpus": self.world, "tokens_per_gpu": seq_len // self.world}
        if c.documents is not None:
            base.update(documents=c.documents[seq_len].spec, mix=c.documents[seq_len].summary())
        single = self._single(seq_len) if seq_len <= c.single_max_len else \
            {"status": f"skipped: longer than the single-GPU limit {c.single_max_len}"}
        rows = [{**base, "variant": f"single-gpu {self.single_backend}", "gpus": 1, **single}]
        self._say(progress_line(rows[0]))
        for name, what, overlap in self.variants():
            balance = c.balance(seq_len, what, self.world) if what in SCHEDULES else None
            row = {**base, "variant": name, "balance": balance}
            make = (partial(PEERS[what], self.group, seq_len, c, self.dtype, self.device)
                    if what in PEERS else partial(self._ours, seq_len, what, overlap))
            slug = name.replace(" (no overlap)", "-no-overlap")
            trace = None if c.profile_dir is None or what in PEERS else \
                os.path.join(c.profile_dir, f"attention-{slug}-{seq_len}-rank{{rank}}.json")
            if what in PEERS and c.documents is not None:
                row["status"] = (f"{what} takes no document mask (it would attend across the "
                                 f"documents), so it is not timed")
            else:
                row.update(self._time(make, flops / self.world, what in PEERS, trace),
                           **checks.get(name, {}))
            if single.get("total_tflops") and row.get("total_tflops"):
                row["vs_single"] = row["total_tflops"] / single["total_tflops"]
            rows.append(row)
            self._say(progress_line(row))
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
    # The rank's work is done and written; end the process without the interpreter's
    # finalizers: on CPU ranks (gloo) one of them called std::terminate now and then after
    # both ranks had finished, and the launcher took that abort for a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(seq_lens: list[int] | None = None, schedules: list[str] | None = None, nproc: int | None = None,
        heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
        dtype: torch.dtype | str | None = None, overlap_ablation: bool = True, peers: bool = True,
        backend: str = "auto", *, documents: str | int | None = None, recipe=None,
        balance_documents: bool = True, repeats: int = 5, warmup: int = 2,
        check_len: int | None = None, single_max_len: int = 262144, min_time_s: float = 0.0,
        profile_dir: str | None = None, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Benchmark distributed attention on ``nproc`` ranks it launches itself (default every CUDA
    GPU, or 2 CPU processes): a result of kind "attention", one row per (seq_len, variant).
    ``seq_lens`` are TOTAL lengths (None: ``DEFAULTS``); ``documents`` a ``--documents`` spec
    (``recipe`` reads a ``data:FILE`` one); ``progress`` must be picklable; the other arguments
    are the CLI options of the same names. ConfigError: bad sizes, names or specs."""
    cuda = torch.cuda.is_available()
    base = DEFAULTS["cuda" if cuda else "cpu"]
    seq_lens = tuple(seq_lens or base["seq_lens"])
    heads, head_dim = heads or base["heads"], head_dim or base["head_dim"]
    dtype = str(dtype or base["dtype"]).replace("torch.", "")
    nproc = nproc or (torch.cuda.device_count() if cuda else 2)
    kv_heads = kv_heads or heads
    schedules = tuple(schedules or SCHEDULES)
    check_len = check_len or min(min(seq_lens), 2048 * nproc)
    _check(seq_lens, schedules, nproc, heads, kv_heads, check_len, cuda)
    docs = None if documents is None else parse_each(documents, seq_lens, recipe=recipe)
    cfg = BenchConfig(seq_lens, schedules, heads, kv_heads, head_dim, dtype, overlap_ablation, peers,
                      backend, repeats, warmup, check_len, single_max_len, min_time_s,
                      profile_dir, progress, docs,
                      None if docs is None else docs[min(seq_lens)].scaled(check_len),
                      balance_documents)
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(nproc, cfg, tmp), nprocs=nproc, join=True)
        with open(os.path.join(tmp, "rows.json")) as f:
            rows = json.load(f)
    meta = {"machine": environment(), "nproc": nproc, "device": "cuda" if cuda else "cpu",
            **{k: v for k, v in asdict(cfg).items() if k not in _NOT_META}, "flop_model": MODEL}
    if docs is not None:
        meta.update(documents=docs[seq_lens[0]].spec, check_documents=cfg.check_documents.summary())
    return BenchResult(kind="attention", title=f"distributed attention, {nproc} ranks",
                       rows=rows, meta=meta)


def _single_backend(backend: str, device: torch.device, dtype: torch.dtype, documents: bool) -> str:
    """The single-GPU row's backend: the named one, or the first that "auto" would try for the
    whole sequence and that loads here (the reference on a CPU without documents)."""
    if backend != "auto":
        return backend
    if device.type != "cuda" and not documents:
        return "reference"
    order = auto_order(device.type, dtype, Relation.PARTIAL if documents else Relation.CAUSAL)
    for name in order:
        with contextlib.suppress(BackendUnavailable):
            get_backend(name)
            return name
    return order[-1]  # the reference: it runs anywhere


def _check(seq_lens, schedules, nproc, heads, kv_heads, check_len, cuda) -> None:
    """Names and sizes every schedule and peer runs (zigzag's 2·nproc chunks), or ConfigError."""
    try:
        for s in schedules:
            check_schedule(s)
        if heads % kv_heads:
            raise ValueError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
        gpus = torch.cuda.device_count()
        if cuda and nproc > gpus:
            raise ValueError(f"--nproc {nproc} exceeds the {gpus} visible GPUs; use at most {gpus}")
        lengths = [(s, "sequence length") for s in seq_lens] + [(check_len, "--check-len")]
        for length, what in lengths:
            check_seq_len(length, nproc, "zigzag", what=what, ranks=f"{nproc} ranks")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
