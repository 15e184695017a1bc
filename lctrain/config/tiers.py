"""Per-layer checkpointing: which policy each decoder layer runs, written as runs of layers.

``train.checkpointing: auto`` lets the memory model choose, per layer, where what its backward
needs is kept; ``train.layer_policies`` states it instead, as ``POLICY=COUNT`` runs in forward
order, e.g. ``full-offload=4,remat-offload=16,remat=12`` for a 32-layer model. The policies of
one layer (:data:`LAYER_POLICIES`), from the cheapest step to the one that saves most memory:

- ``none``: the layer is not checkpointed: it keeps every activation its backward needs, and
  nothing of it runs again (the memory model places these where the GPU has room to spare);
- ``remat``: the layer input, attention output and lse stay on the GPU;
- ``remat-offload``: the same tensors wait in pinned host memory;
- ``full``: only the layer input is kept, on the GPU; the attention forward runs again;
- ``full-offload``: only the layer input is kept, in pinned host memory;
- ``full-paired``: the layers of the run go in pairs of full layers, and the upper layer of each
  pair keeps nothing: its input is rebuilt in the backward by running the lower layer's forward
  again (`lctrain.parallel.pairs`) — half the kept inputs, one more layer forward per pair. A run
  of an odd count ends with one plain full layer.

`per_layer` expands runs into one kind per layer (:data:`LAYER_KINDS`): a ``full-paired`` run
becomes ``full``, ``chained``, ``full``, ``chained``, ...
"""
from __future__ import annotations

from lctrain.errors import ConfigError

LAYER_POLICIES = ("none", "remat", "remat-offload", "full", "full-offload", "full-paired")
"""Checkpointing policies one layer of a mixed (``auto``) run can have."""

LAYER_KINDS = ("none", "remat", "remat-offload", "full", "full-offload", "chained")
"""What each layer runs once runs are expanded (`per_layer`): ``chained`` is the upper layer of a
``full-paired`` pair, whose input is rebuilt from the full layer below it."""

OFFLOADED = frozenset({"remat-offload", "full-offload"})
"""Layer policies whose kept tensors live in pinned host memory."""

_KEY = "train.layer_policies"


def parse_layer_policies(text: str) -> tuple[tuple[str, int], ...]:
    """``"full-offload=4,remat=28"`` -> ``(("full-offload", 4), ("remat", 28))``.

    Raises:
        ConfigError: an item that is not POLICY=COUNT, an unknown policy, a count below 1.
    """
    runs = []
    for item in (part.strip() for part in str(text).split(",")):
        name, sep, count = item.partition("=")
        name = name.strip()
        if not sep or not count.strip().isdigit():
            raise ConfigError(f"{_KEY} item {item!r} is not POLICY=COUNT; write e.g. "
                              "full-offload=4,remat-offload=16,remat=12", key=_KEY)
        if name not in LAYER_POLICIES:
            raise ConfigError(f"{_KEY} names {name!r}, which is not one of "
                              f"{', '.join(LAYER_POLICIES)}", key=_KEY)
        if int(count) < 1:
            raise ConfigError(f"{_KEY} gives {name} {count} layers; a run needs at least 1 (leave "
                              "it out instead)", key=_KEY)
        runs.append((name, int(count)))
    return tuple(runs)


def format_layer_policies(runs: tuple[tuple[str, int], ...]) -> str:
    """The ``train.layer_policies`` text of ``runs`` (the inverse of `parse_layer_policies`)."""
    return ",".join(f"{name}={count}" for name, count in runs)


def per_layer(runs: tuple[tuple[str, int], ...]) -> list[str]:
    """The kind of every layer (:data:`LAYER_KINDS`), in forward order."""
    return [("chained" if i % 2 else "full") if name == "full-paired" else name
            for name, count in runs for i in range(count)]
