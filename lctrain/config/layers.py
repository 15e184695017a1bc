"""One parser for ``train.checkpointing`` (none, remat, full, auto, or runs such as
``full=4,remat=28``) and ``train.offload`` (none; ``layers`` or ``layers=N``, the lowest N; and
``optimizer`` or ``state``): a `LayerPlan`, whose two properties print the fields' exact text."""
from __future__ import annotations

from dataclasses import dataclass, replace

from lctrain.errors import ConfigError

KINDS = ("none", "remat", "full")
"""How one layer is kept: not checkpointed, rematerialized, or fully recomputed."""
STATES = ("none", "optimizer", "state")
"""Where the training state lives besides the GPU: nowhere, AdamW's states, all of it."""
ALL = 0
"""A run count meaning every layer (``train.checkpointing: remat``)."""

_CKPT, _OFFLOAD = "train.checkpointing", "train.offload"
_OLD = {"remat-offload": "train.checkpointing=remat with train.offload=layers",
        "full-offload": "train.checkpointing=full with train.offload=layers",
        "full-paired": "train.checkpointing=full (paired layers are gone)"}


@dataclass(frozen=True)
class LayerPlan:
    """The parsed fields: ``runs`` (``()``: auto), the lowest ``parked`` layers, the ``state``."""

    runs: tuple[tuple[str, int], ...] = (("none", ALL),)
    parked: int | None = 0
    state: str = "none"

    @classmethod
    def parse(cls, checkpointing: str = "none", offload: str = "none") -> LayerPlan:
        """Raises: ConfigError: an unknown or old item, or a combination that cannot run."""
        plan = cls(_parse_runs(str(checkpointing)), *_parse_offload(str(offload)))
        if plan.auto and plan.parked != 0:
            raise ConfigError(f"{_OFFLOAD} names layers but {_CKPT} is auto, which chooses the "
                              f"parked layers itself; drop layers from {_OFFLOAD} or write the "
                              f"runs in {_CKPT}", key=_OFFLOAD)
        if plan.runs and {kind for kind, _ in plan.runs} == {"none"} and plan.parked != 0:
            raise ConfigError(f"{_OFFLOAD} names layers but {_CKPT} is {plan.checkpointing}, so "
                              f"no layer keeps tensors to park; choose remat, full or runs",
                              key=_OFFLOAD)
        return plan

    @property
    def auto(self) -> bool:
        """Whether the memory model chooses the runs and the parked layers."""
        return not self.runs

    @property
    def checkpointing(self) -> str:
        """The ``train.checkpointing`` text."""
        if self.auto:
            return "auto"
        if self.runs[0][1] == ALL:
            return self.runs[0][0]
        return ",".join(f"{kind}={count}" for kind, count in self.runs)

    @property
    def offload(self) -> str:
        """The ``train.offload`` text."""
        items = [] if self.parked == 0 else ["layers" if self.parked is None
                                             else f"layers={self.parked}"]
        items += [] if self.state == "none" else [self.state]
        return ",".join(items) or "none"

    def kinds(self, layers: int) -> tuple[str, ...]:
        """Every layer's kind (ConfigError: ``auto``, or runs not covering ``layers``)."""
        if self.auto:
            raise ConfigError(f"{_CKPT} auto has no kinds until the memory model places them",
                              key=_CKPT)
        if self.runs[0][1] == ALL:
            return (self.runs[0][0],) * layers
        given = sum(count for _, count in self.runs)
        if given != layers:
            raise ConfigError(f"{_CKPT} {self.checkpointing} covers {given} layers but the model "
                              f"has {layers}; make the counts add up to {layers}", key=_CKPT)
        return tuple(kind for kind, count in self.runs for _ in range(count))

    def parked_layers(self, layers: int) -> tuple[bool, ...]:
        """Whether each layer parks its kept tensors (ConfigError: as `kinds`, or too many)."""
        kinds = self.kinds(layers)
        if self.parked is not None and self.parked > layers:
            raise ConfigError(f"{_OFFLOAD} parks {self.parked} layers but the model has {layers}",
                              key=_OFFLOAD)
        limit = layers if self.parked is None else self.parked
        return tuple(kind != "none" and i < limit for i, kind in enumerate(kinds))

    def count(self, kind: str, layers: int) -> int:
        """Layers of ``kind`` (0 for ``auto``)."""
        return 0 if self.auto else self.kinds(layers).count(kind)

    def placed(self, runs: tuple[tuple[str, int], ...], parked: int) -> LayerPlan:
        """This plan with the runs and parked layers an ``auto`` placement chose."""
        return replace(self, runs=((runs[0][0], ALL),) if len(runs) == 1 else runs, parked=parked)


def _parse_runs(text: str) -> tuple[tuple[str, int], ...]:
    text = text.strip()
    if text == "auto":
        return ()
    if text in KINDS:
        return ((text, ALL),)
    runs = []
    for item in (part.strip() for part in text.split(",")):
        kind, sep, count = (part.strip() for part in item.partition("="))
        if kind in _OLD:
            raise ConfigError(f"{_CKPT} {kind} is gone; use {_OLD[kind]}", key=_CKPT)
        if kind not in KINDS or not sep or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"{_CKPT} item {item!r} is not one of none, remat, full, auto or "
                              f"runs such as full=4,remat=28", key=_CKPT)
        runs.append((kind, int(count)))
    return tuple(runs)


def _parse_offload(text: str) -> tuple[int | None, str]:
    parked, state = 0, "none"
    items = [part.strip() for part in text.split(",")]
    if items == ["none"]:
        return parked, state
    for item in items:
        name, sep, count = (part.strip() for part in item.partition("="))
        if name == "layers" and parked == 0 and (not sep or count.isdigit() and int(count) > 0):
            parked = int(count) if sep else None
        elif name in STATES[1:] and not sep and state == "none":
            state = name
        elif name == "all" and not sep:
            raise ConfigError(f"{_OFFLOAD} all is gone; use {_OFFLOAD}=state (parameters, "
                              f"gradients and AdamW states)", key=_OFFLOAD)
        else:
            raise ConfigError(f"{_OFFLOAD} item {item!r} is not none or one of layers, "
                              f"layers=N (N > 0), optimizer, state (each at most once; "
                              f"optimizer or state)", key=_OFFLOAD)
    return parked, state
