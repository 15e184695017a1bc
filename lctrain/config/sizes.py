"""Human-friendly sizes: token counts ("256k") and memory amounts ("80GiB").

Token counts are binary: ``k`` = 1024 and ``m`` = 1024², as long-context lengths are usually
quoted (a "256K context" is 262144 tokens). Memory amounts accept ``GiB``/``G`` (binary) and
``GB`` (decimal, 10⁹), plus the same for M, K and T.
"""
from __future__ import annotations

import re

from lctrain.errors import ConfigError

_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_MEMORY_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def _split(text: str) -> tuple[str, str] | None:
    match = _PATTERN.match(text.lower())
    return (match.group(1), match.group(2)) if match else None


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Parse a token count such as ``512``, ``"64k"``, ``"256K"`` or ``"1m"``.

    Args:
        value: an int, or a string: a whole number with an optional k/m/g suffix (powers of 1024).
        what: how the value is named in the error message (e.g. ``"--seq-len"``).

    Returns:
        The count as an int.

    Raises:
        ConfigError: the text is not a whole number with a known suffix, or not positive.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number of tokens such as 4096 or 256k, got {value!r}")
    if isinstance(value, int):
        count = value
    else:
        parts = _split(str(value))
        if parts is None or parts[1] not in _TOKEN_UNITS or "." in parts[0]:
            raise ConfigError(f"{what} {value!r} is not a size; write a whole number with an "
                              f"optional k or m suffix (k = 1024), such as 4096, 64k or 1m")
        count = int(parts[0]) * _TOKEN_UNITS[parts[1]]
    if count <= 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return count


def parse_size_list(text: str, *, what: str = "size list") -> list[int]:
    """Parse a comma-separated list of sizes such as ``"16k,32k,64k"``."""
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{what} is empty; give one or more sizes such as 16k,32k")
    return [parse_size(item.strip(), what=what) for item in items]


def parse_memory(value: int | str, *, what: str = "memory size") -> int:
    """Parse a memory amount such as ``"80GiB"``, ``"80GB"``, ``"80G"`` or a byte count.

    Args:
        value: an int (bytes) or a string with unit B, K/KiB/KB, M/MiB/MB, G/GiB/GB or T/TiB/TB;
            the bare letter and the ``iB`` forms are binary (1024-based), ``B`` forms decimal.
        what: how the value is named in the error message.

    Returns:
        The amount in bytes.

    Raises:
        ConfigError: the text is not an amount with a known unit, or not positive.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        amount = value
    else:
        parts = _split(str(value))
        if parts is None or parts[1] not in _MEMORY_UNITS:
            raise ConfigError(f"{what} {value!r} is not a memory size; write it like 80GiB, "
                              f"80GB or 80G (G and GiB = 1024³ bytes, GB = 10⁹)")
        amount = int(float(parts[0]) * _MEMORY_UNITS[parts[1]])
    if amount <= 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return amount


def format_bytes(count: float) -> str:
    """Render a byte count with a binary unit, e.g. ``"12.3 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def format_tokens(count: int) -> str:
    """Render a token count the way users type it: 262144 -> ``"256k"``, 1000 -> ``"1000"``."""
    for suffix, unit in (("m", 1024**2), ("k", 1024)):
        if count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)
