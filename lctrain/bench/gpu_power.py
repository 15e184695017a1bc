"""The GPUs' SM clock and power draw while a configuration of `lctrain.bench.step` runs, as
``nvidia-smi`` samples them: a GPU held at its power limit lowers its clock, and the same step
takes longer, so a row says what they were over its timed steps."""
from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
from datetime import datetime
from typing import Iterator

FIELDS = ("sm_clock_ghz", "power_w", "power_limit_w")
_SCALE = (1e-3, 1.0, 1.0)  # nvidia-smi gives MHz
_QUERY = "--query-gpu=timestamp,clocks.sm,power.draw,power.limit"


@contextlib.contextmanager
def sampled(gpus: int, every_ms: int = 250) -> Iterator[list[tuple[float, ...]]]:
    """A list that, once the block ends, holds (unix time, *FIELDS) of the run's ``gpus`` GPUs
    (the first visible; not an idle one at its free clock) every ``every_ms``, or stays empty."""
    samples: list[tuple[float, ...]] = []
    smi, visible = shutil.which("nvidia-smi"), os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible is not None else [str(i) for i in range(gpus)]
    with tempfile.TemporaryFile("w+") as out:
        proc = smi and subprocess.Popen(
            [smi, f"--id={','.join(ids[:gpus])}", _QUERY, "--format=csv,noheader,nounits",
             f"--loop-ms={every_ms}"], stdout=out, stderr=subprocess.DEVNULL)
        try:
            yield samples
        finally:
            if proc:
                proc.terminate()
                proc.wait()
                out.seek(0)
                samples.extend(parse(out.read()))


def parse(text: str) -> list[tuple[float, ...]]:
    """The rows of ``nvidia-smi`` CSV lines (timestamp first); lines it cannot read are left."""
    rows = []
    for line in text.splitlines():
        stamp, *values = (part.strip() for part in line.split(","))
        with contextlib.suppress(ValueError):
            when = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            if len(values) == len(FIELDS):
                rows.append((when, *(float(v) * s for v, s in zip(values, _SCALE))))
    return rows


def during(samples: list[tuple[float, ...]], start: float, end: float) -> dict:
    """Each of FIELDS' median over the samples from ``start`` to ``end`` (None: no sample)."""
    inside = [s[1:] for s in samples if start <= s[0] <= end]
    return {name: statistics.median(s[i] for s in inside) if inside else None
            for i, name in enumerate(FIELDS)}
