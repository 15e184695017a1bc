"""Numbers as people read them: 64K tokens, 1.2 ms, 531 TFLOP/s, 6.74 B parameters.

Three significant digits, never fewer than the integer part; :func:`time_unit` and :func:`rate_unit`
choose one unit for a whole column."""
from __future__ import annotations

import math

from lctrain.config.fields import format_tokens


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits and thousands separators: 531.2 -> "531",
    5312.4 -> "5,312", 0.001234 -> "0.00123"; an int keeps every digit."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if value == 0:
        return "0"
    if not math.isfinite(value):
        return str(value)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:,.{decimals}f}"
    # rounding may carry into a new digit (9.996 -> "10.00"): drop the extra decimal
    if decimals and len(text.replace(",", "").replace("-", "").replace(".", "").lstrip("0")) > digits:
        text = f"{value:,.{decimals - 1}f}"
    return text


def tokens(count: int) -> str:
    """A token count as typed: 65536 -> "64K", 1048576 -> "1M", 1000 -> "1,000" (never rounded)."""
    count = int(count)
    typed = format_tokens(count)  # "64k", "1m"; "1000"
    return typed.upper() if count and typed[-1] in "km" else f"{count:,}"


def parameters(count: int) -> str:
    """A parameter count: 6738415616 -> "6.74 B", 1234567 -> "1.23 M", 52480 -> "52,480"."""
    if count >= 1e9:
        return f"{significant(count / 1e9)} B"
    if count >= 1e6:
        return f"{significant(count / 1e6)} M"
    return f"{int(count):,}"


def time_unit(milliseconds: list[float]) -> tuple[str, float]:
    """(unit, factor from ms) that shows a column of durations best: µs, ms or s."""
    finite = [abs(v) for v in milliseconds if v is not None and math.isfinite(v)]
    if finite and max(finite) < 1.0:
        return "µs", 1e3
    if finite and min(finite) >= 1000.0:
        return "s", 1e-3
    return "ms", 1.0


def duration(seconds: float) -> str:
    """A wall time: 0.0123 -> "12.3 ms", 8.68 -> "8.68 s", 754 -> "12 min 34 s"."""
    if seconds < 1.0:
        return f"{significant(seconds * 1e3)} ms"
    if seconds < 60.0:
        return f"{significant(seconds)} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def rate_unit(tflops: list[float]) -> tuple[str, float]:
    """(unit, factor from TFLOP/s) for a column of FLOP rates: TFLOP/s, GFLOP/s or MFLOP/s."""
    largest = max((abs(v) for v in tflops if v is not None and math.isfinite(v)), default=1.0)
    if largest >= 1.0:
        return "TFLOP/s", 1.0
    if largest >= 1e-3:
        return "GFLOP/s", 1e3
    return "MFLOP/s", 1e6


def rate(tflops: float) -> str:
    """One FLOP rate with its own unit: 531.2 -> "531 TFLOP/s", 0.0123 -> "12.3 GFLOP/s"."""
    unit, factor = rate_unit([tflops])
    return f"{significant(tflops * factor)} {unit}"


def milliseconds(ms: float) -> str:
    """One duration given in ms with its own unit: 0.5 -> "500 µs", 31.2 -> "31.2 ms"."""
    unit, factor = time_unit([ms])
    return f"{significant(ms * factor)} {unit}"


def ratio(value: float) -> str:
    """A ratio to a reference: 0.9456 -> "0.946×"."""
    return f"{significant(value)}×"


def percent(fraction: float) -> str:
    """A fraction as a percentage with one decimal: 0.4321 -> "43.2 %"."""
    return f"{100 * fraction:.1f} %"


def gib(count: float) -> str:
    """Bytes as GiB with three significant digits: 67452000000 -> "62.8"."""
    return significant(count / (1 << 30))
