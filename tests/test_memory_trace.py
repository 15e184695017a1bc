"""The step's memory peak is replayed from allocator events (`lctrain.train.memory_trace`).

The events are drawn at random and the replay is checked against a direct walk that keeps the
set of live blocks by hand; the recording itself needs a GPU (``tests/test_gpu_*``)."""
from __future__ import annotations

import random

import torch

from lctrain.train.memory_trace import _replay, peak_report, traced_step


def _event(action, addr, size, where):
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                       {"filename": f"/x/lctrain/{where}.py", "line": 7, "name": where}]}


def _random_events(rng):
    """Allocations and frees; a free completes at once or, for a block another stream still
    uses, some events later."""
    events, live, pending, next_addr = [], {}, [], 1
    for _ in range(rng.randrange(20, 200)):
        if pending and rng.random() < 0.3:
            addr, size = pending.pop(rng.randrange(len(pending)))
            events.append(_event("free_completed", addr, size, "x"))
        elif live and rng.random() < 0.45:
            addr = rng.choice(sorted(live))
            size = live.pop(addr)
            events.append(_event("free_requested", addr, size, "x"))
            pending.append((addr, size))
        else:
            size = rng.randrange(1, 1 << 20)
            live[next_addr] = size
            events.append(_event("alloc", next_addr, size, rng.choice(["mlp", "attention"])))
            next_addr += 1
    return events


def test_replay_finds_the_peak_and_the_blocks_alive_then():
    rng = random.Random(torch.initial_seed())  # the test's seed (conftest.py)
    for _ in range(50):
        events = _random_events(rng)
        before = rng.randrange(0, 1 << 22)
        peak, at, live = _replay(events, before)
        current, best, best_live, alive = before, before, set(), {}
        for i, e in enumerate(events):
            if e["action"] == "alloc":
                current += e["size"]
                alive[e["addr"]] = i
                if current > best:
                    best, best_live = current, set(alive.values())
            elif e["action"] == "free_requested":
                current -= e["size"]
                alive.pop(e["addr"])
        assert peak == best and set(live) == best_live
        if at is not None:
            assert events[at]["action"] == "alloc" and at in live
            assert before + sum(events[i]["size"] for i in live) == peak


def test_a_free_of_a_block_from_before_the_step_lowers_the_running_total():
    events = [_event("free_requested", 99, 500, "x"), _event("alloc", 1, 300, "mlp"),
              _event("free_completed", 99, 500, "x")]
    assert _replay(events, 1000) == (1000, None, [])
    events.append(_event("alloc", 2, 400, "attention"))
    assert _replay(events, 1000) == (1200, 3, [1, 3])


def test_a_block_another_stream_still_uses_counts_as_freed_when_its_free_is_requested():
    """As ``torch.cuda.max_memory_allocated`` counts it: the allocator lowers its allocated
    bytes at the request and only delays the block's reuse."""
    events = [_event("alloc", 1, 400, "comm"), _event("free_requested", 1, 400, "comm"),
              _event("alloc", 2, 300, "mlp"), _event("free_completed", 1, 400, "comm")]
    assert _replay(events, 0) == (400, 0, [0])


def test_the_report_names_each_site_and_the_bytes_from_before():
    gib = 1 << 30
    events = [_event("alloc", 1, 3 * gib, "mlp"), _event("alloc", 2, gib, "attention"),
              _event("alloc", 3, gib, "mlp"), _event("free_requested", 2, gib, "attention")]
    text = peak_report(events, before=2 * gib)
    assert "peak during the step: 7.00 GiB" in text
    assert "2.00 GiB  allocated before the step" in text
    assert "4.00 GiB      2 blocks  lctrain/mlp.py:7 mlp" in text
    assert "1.00 GiB      1 blocks  lctrain/attention.py:7 attention" in text
    assert "lctrain/mlp.py:7 mlp" in text.split("innermost frame first:")[1].splitlines()[2]


def test_tracing_is_a_no_op_without_a_folder_or_off_a_gpu(tmp_path):
    import torch

    for folder in (None, tmp_path):
        with traced_step(folder, torch.device("cpu"), 0, 1) as spent:
            pass
        assert spent == {"outside_s": 0.0}  # nothing for the step's time to leave out
    assert not list(tmp_path.iterdir())


def test_the_inventory_counts_each_storage_once_under_its_owner():
    import torch

    from lctrain.train.memory_trace import inventory

    device = torch.device("cpu")
    layer = torch.nn.Linear(67, 29)  # shapes no other test leaves behind
    layer(torch.randn(4, 67)).sum().backward()
    optimizer = torch.optim.AdamW(layer.parameters())
    optimizer.step()
    keep = torch.zeros(1009, 3)  # noqa: F841 - another tensor the collector reaches
    text = inventory(device, layer, optimizer, top=1 << 30)  # every shape, whatever else lives
    weights = (67 * 29 + 29) * 4
    assert f"{weights / 2**30:.2f} GiB  parameters" in text
    assert "(1009, 3) float32" in text
    assert "(29, 67) float32" not in text  # counted once, as a parameter


def test_the_inventory_passes_over_tensors_that_own_no_memory():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lctrain.train.memory_trace import inventory

    with FakeTensorMode():
        fake = torch.empty(1 << 20)  # noqa: F841 - the collector reaches it
    assert "alive when the step began" in inventory(torch.device("cpu"))
