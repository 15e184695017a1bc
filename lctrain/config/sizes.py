"""Sizes as people write them: token counts ("256k", k = 1024) and memory ("80GiB" or "80G"
binary, "80GB" decimal)."""
from __future__ import annotations

import re

from lctrain.errors import ConfigError

_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_MEMORY_UNITS = {"": 1, "b": 1, **{f"{p}{s}": base ** (i + 1) for i, p in enumerate("kmgt")
                                    for s, base in (("", 1024), ("ib", 1024), ("b", 1000))}}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def _split(text: str) -> tuple[str, str] | None:
    match = _PATTERN.match(text.lower())
    return (match.group(1), match.group(2)) if match else None


def parse_size(value: int | str, *, what: str = "size") -> int:
    """A token count such as ``512``, ``"64k"`` or ``"1m"`` (ConfigError naming ``what``)."""
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
    """Bytes of an int, ``80GiB`` / ``80G`` (binary) or ``80GB`` (decimal); ConfigError."""
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
