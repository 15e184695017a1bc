"""The names the whole project agrees on: schedules, layouts, backends, and how a sequence divides.

A **schedule** says who computes which attention block when (``distributed.schedule``): balanced
DistFlashAttn (the default), the plain ring (the unbalanced baseline), or the ring over the zigzag
layout. Each expects one **layout**, the way the sequence is cut over the ranks
(``distributed.layout``): ``contiguous`` gives rank r chunk r of P, ``zigzag`` chunks r and 2P−1−r
of 2P. A **backend** computes one local attention block (``backends``). Standard library only, so
the recipe schema and the CLI read these names without loading torch."""
from __future__ import annotations

SCHEDULES = ("distflash", "ring", "zigzag")
LAYOUTS = ("contiguous", "zigzag")

_CHUNKS_PER_RANK = {"contiguous": 1, "zigzag": 2}
_SCHEDULE_LAYOUT = {"distflash": "contiguous", "ring": "contiguous", "zigzag": "zigzag"}

BACKENDS = {  # name -> ``module.Class`` under lctrain_kernels.backends, imported when asked for
    "reference": "reference.ReferenceBackend",
    "cudnn": "sdpa.CudnnBackend",
    "triton": "triton.TritonBackend",
    "cpu_flash": "sdpa.CpuFlashBackend",
    "cudnn_ragged": "cudnn_ragged.CudnnRaggedBackend",
    "flash_attn_cute": "flash_attn_cute.FlashAttnCuteBackend",
}


def check_schedule(kind: str) -> str:
    """``kind`` if it names a schedule, else ValueError."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    return kind


def schedule_layout(kind: str) -> str:
    """The layout schedule ``kind`` expects ``shard`` to use."""
    return _SCHEDULE_LAYOUT[check_schedule(kind)]


def chunks_per_rank(layout: str) -> int:
    """Equal chunks each rank holds: 1 for "contiguous", 2 for "zigzag"."""
    if layout not in _CHUNKS_PER_RANK:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return _CHUNKS_PER_RANK[layout]


def seq_chunks(world_size: int, layout: str) -> int:
    """Equal chunks the global sequence is cut into: a valid length is a multiple of this."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    return world_size * chunks_per_rank(layout)


def check_seq_len(seq_len: int, world_size: int, layout: str, *, what: str = "sequence length",
                  ranks: str | None = None) -> int:
    """The chunk length of ``seq_len`` over ``world_size`` ranks in ``layout``, or a ValueError
    naming the nearest lengths that work; ``what`` and ``ranks`` name the length and the ranks
    in the message (e.g. "data.seq_len", "parallel.cp")."""
    parts = seq_chunks(world_size, layout)
    if isinstance(seq_len, int) and seq_len > 0 and seq_len % parts == 0:
        return seq_len // parts
    per = chunks_per_rank(layout)
    ranks = ranks or f"world size {world_size}"
    how = ranks if per == 1 else f"{per} × {ranks}"
    low = seq_len // parts * parts if isinstance(seq_len, int) else 0
    nearest = f"{low} or {low + parts}" if low > 0 else str(parts)
    raise ValueError(f"{what} {seq_len} is not divisible by {parts} ({how} for the {layout} "
                     f"layout); use a multiple of {parts} such as {nearest}")
