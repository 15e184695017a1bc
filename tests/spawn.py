"""Run a function on N CPU processes joined in a gloo process group (for tests).

Usage: ``results = run_on_ranks(worker, 3, arg1, arg2)`` where ``worker(rank, world_size, *args)``
is a module-level function; it returns one picklable value per rank. The first exception raised
on any rank is re-raised here with that rank's traceback (not another rank's "connection reset").
"""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from datetime import timedelta


def _entry(fn, rank, world_size, init_method, queue, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - forwarded to the parent verbatim
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init_method, queue, args))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        for _ in range(world_size):
            rank, ok, payload = queue.get()
            (results if ok else errors)[rank] = payload
            if errors:
                break
        for p in procs:
            p.join(timeout=timeout if not errors else 5)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
