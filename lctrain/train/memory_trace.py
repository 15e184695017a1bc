"""Where a step's GPU memory peak comes from (``lctrain bench step --memory-trace DIR``): with
``LCTRAIN_MEMORY_TRACE=DIR`` every rank records the allocator over the last step and writes its
snapshot and a ``-peak.txt`` report. Recomputation does not stop early then (pytorch#179536)."""
from __future__ import annotations

import contextlib
import gc
import os
import pickle
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

ENV = "LCTRAIN_MEMORY_TRACE"
OWN_CODE = ("/lctrain/", "/lctrain_kernels/", "/transformers/")  # frames that name a site
_ENTRIES = 2_000_000


def trace_folder() -> Path | None:
    """The folder the environment asks the traces for (None: no tracing)."""
    folder = os.environ.get(ENV)
    return Path(folder) if folder and torch.cuda.is_available() else None


@contextlib.contextmanager
def traced_step(folder: Path | None, device: torch.device, rank: int, step: int,
                module: torch.nn.Module | None = None, optimizer=None):
    """Record the allocator's history around one step and write its snapshot and peak report
    into ``folder`` (nothing without a folder or off a GPU). Yields a dict whose
    ``outside_s`` is, on exit, the seconds spent around the step (the inventory, the snapshot,
    writing), which the step's time leaves out."""
    spent = {"outside_s": 0.0}
    if folder is None or device.type != "cuda":
        yield spent
        return
    entered = time.perf_counter()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    alive = inventory(device, module, optimizer)
    torch.cuda.memory._record_memory_history(max_entries=_ENTRIES, stacks="python", device=device)
    try:
        start = time.perf_counter()
        with set_checkpoint_early_stop(False):
            yield spent
        torch.cuda.synchronize(device)
        step_s = time.perf_counter() - start
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"rank{rank}-step{step}"
    with open(f"{stem}.pickle", "wb") as f:
        pickle.dump(snapshot, f)
    events = snapshot["device_traces"][device.index or 0]
    Path(f"{stem}-peak.txt").write_text(peak_report(events, before) + alive)
    spent["outside_s"] = time.perf_counter() - entered - step_s


def peak_report(events: list[dict], before: int, top: int = 30) -> str:
    """The text of ``-peak.txt`` from one device's allocator events and the bytes allocated
    when they began."""
    peak, at, live = _replay(events, before)
    lines = [f"allocated when the step began: {_gib(before)}",
             f"peak during the step: {_gib(peak)}", ""]
    if at is not None:
        lines += ["the allocation that reached the peak "
                  f"({_gib(events[at]['size'])}), innermost frame first:"]
        lines += [f"  {f['filename']}:{f['line']} {f['name']}" for f in _frames(events[at])[:40]]
        lines.append("")
    earlier = peak - sum(events[i]["size"] for i in live)
    rows = _grouped((_site(events[i]), events[i]["size"]) for i in live)
    lines.append("alive at the peak, by the code that allocated it:")
    lines.append(f"  {_gib(earlier):>12}  allocated before the step and not freed in it")
    for key, (size, count) in rows[:top]:
        lines.append(f"  {_gib(size):>12}  {count:>5} blocks  {key}")
    rest = rows[top:]
    if rest:
        lines.append(f"  {_gib(sum(v[0] for _, v in rest)):>12}  {len(rest)} more sites")
    return "\n".join(lines) + "\n"


def inventory(device: torch.device, module: torch.nn.Module | None = None, optimizer=None,
              top: int = 15) -> str:
    """What holds the memory on ``device`` now: parameters, gradients, optimizer states and
    every other tensor the garbage collector reaches, by shape and dtype (each storage once)."""
    seen: set[int] = set()

    def storage_bytes(tensors) -> int:
        total = 0
        for t in tensors:
            local = getattr(t, "_local_tensor", t)
            if not isinstance(local, torch.Tensor) or local.device != device:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    storage = local.untyped_storage()
                    storage.data_ptr()
            except RuntimeError:  # a fake or functional tensor (tracing) owns no memory
                continue
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = list(module.parameters()) if module is not None else []
    named = [("parameters", storage_bytes(params)),
             ("gradients", storage_bytes(p.grad for p in params if p.grad is not None))]
    if optimizer is not None:
        named.append(("optimizer states", storage_bytes(
            v for state in optimizer.state.values() for v in state.values())))
    with warnings.catch_warnings():  # deprecated module attributes warn when looked at
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if _is_tensor_on(obj, device)]
    sized = ((obj, storage_bytes([obj])) for obj in tensors)
    rows = _grouped((f"{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')}", nbytes)
                    for obj, nbytes in sized if nbytes)
    lines = ["", f"alive when the step began ({_gib(torch.cuda.memory_allocated(device))} "
             "allocated), by owner:"]
    lines += [f"  {_gib(n):>12}  {name}" for name, n in named]
    lines += [f"  {_gib(n):>12}  {count:>5} tensors  {key}" for key, (n, count) in rows[:top]]
    return "\n".join(lines) + "\n"


def _grouped(pairs) -> list[tuple[str, list[int]]]:
    """(key, [bytes, count]) per key of ``(key, bytes)`` pairs, the most bytes first."""
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, nbytes in pairs:
        groups[key][0] += nbytes
        groups[key][1] += 1
    return sorted(groups.items(), key=lambda kv: -kv[1][0])


def _is_tensor_on(obj, device: torch.device) -> bool:
    try:
        return isinstance(obj, torch.Tensor) and obj.device == device
    except Exception:  # noqa: BLE001 - lazy or dead objects answer oddly
        return False


def _replay(events: list[dict], before: int) -> tuple[int, int | None, list[int]]:
    """(peak bytes, index of the event that reached it, indices of the step's allocations
    alive then). A block is freed when its free is requested, as
    ``torch.cuda.max_memory_allocated`` counts it, though one that another stream still uses
    (the ring's buffers) is reused only once that stream's work completes."""
    current, peak, at = before, before, None
    open_allocs: dict[int, int] = {}  # address -> event index
    live_at_peak: list[int] = []
    for index, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            current += event["size"]
            open_allocs[event["addr"]] = index
            if current > peak:
                peak, at = current, index
                live_at_peak = list(open_allocs.values())
        elif action == "free_requested":
            current -= event["size"]
            open_allocs.pop(event["addr"], None)
    return peak, at, live_at_peak


def _frames(event: dict) -> list[dict]:
    return [f for f in event.get("frames", ()) if f.get("filename")]


def _site(event: dict) -> str:
    frames = _frames(event)
    if not frames:
        return "(no Python frame)"
    # our innermost frame (not a dispatch mode's, which sits under every op), else the innermost
    frame = next((f for f in frames if any(part in f["filename"] for part in OWN_CODE)
                  and f["name"] != "__torch_dispatch__"), frames[0])
    return f"{_short(frame['filename'])}:{frame['line']} {frame['name']}"


def _short(path: str) -> str:
    for part in ("/lctrain_kernels/", "/lctrain/", "/transformers/", "/torch/"):
        if part in path:
            return part.strip("/") + "/" + path.split(part, 1)[1]
    return path


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
