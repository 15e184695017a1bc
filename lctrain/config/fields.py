"""Type checks for the config dataclasses, driven by their annotations: the lossless
conversions YAML needs (an int for a float, a list for a tuple, ``"3e-3"``, sizes for fields
marked :data:`SIZE` / :data:`MEMORY`), else a one-sentence ConfigError naming key and value;
and sizes as people write them: tokens ("256k", k = 1024), memory ("80GiB", "80G"; "80GB": 10⁹)."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from typing import Any, Literal

from lctrain.errors import ConfigError

SIZE = {"unit": "tokens"}
"""Field metadata: the int field also accepts a size string such as ``"256k"``."""
MEMORY = {"unit": "bytes"}
"""Field metadata: the int field also accepts a memory size such as ``"240GiB"``."""


def at_least(low: int, note: str = "") -> dict:
    """Field metadata: the value (unless null) must be at least ``low``; ``note`` ends the error."""
    return {"min": (low, note)}


FLOAT32_MAX = 3.4028234663852886e38
_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_MEMORY_UNITS = {"": 1, "b": 1, **{f"{p}{s}": base ** (i + 1) for i, p in enumerate("kmgt")
                                    for s, base in (("", 1024), ("ib", 1024), ("b", 1000))}}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_size(value: int | str, *, what: str = "size") -> int:
    """A token count such as ``512``, ``"64k"`` or ``"1m"`` (ConfigError naming ``what``)."""
    return _parse(value, what, _TOKEN_UNITS, "is not a size; write a whole number with an "
                  "optional k or m suffix (k = 1024), such as 4096, 64k or 1m")


def _parse(value: int | str, what: str, units: dict[str, int], bad: str) -> int:
    """A positive int, or a number and one of ``units`` (whole unless ``units`` are memory's)."""
    if isinstance(value, int) and not isinstance(value, bool):
        amount = value
    else:
        match = _PATTERN.match(str(value).lower())
        if match is None or match[2] not in units or (units is _TOKEN_UNITS and "." in match[1]):
            raise ConfigError(f"{what} {value!r} {bad}")
        amount = int((float if "." in match[1] else int)(match[1]) * units[match[2]])
    if amount <= 0:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return amount


def parse_size_list(text: str, *, what: str = "size list") -> list[int]:
    """Parse a comma-separated list of sizes such as ``"16k,32k,64k"``."""
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{what} is empty; give one or more sizes such as 16k,32k")
    return [parse_size(item.strip(), what=what) for item in items]


def parse_memory(value: int | str, *, what: str = "memory size") -> int:
    """Bytes of an int, ``80GiB`` / ``80G`` (binary) or ``80GB`` (decimal); ConfigError.

    A number under a MiB with no unit is refused: "141" meant GiB, not 141 bytes."""
    bad = "is not a memory size; write it like 80GiB, 80GB or 80G (G and GiB = 1024³ bytes, GB = 10⁹)"
    amount = _parse(value, what, _MEMORY_UNITS, bad)
    unit = "" if isinstance(value, int) else _PATTERN.match(str(value).lower())[2]
    if amount < 1024**2 and not unit:
        raise ConfigError(f"{what} {value!r} has no unit, so it would be {amount} bytes; "
                          f"write it like {value}GiB")
    return amount


def format_bytes(count: float) -> str:
    """Render a byte count with a binary unit, e.g. ``"12.3 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def format_tokens(count: int) -> str:
    """Render a token count the way users type it: 262144 -> ``"256k"``, 1000 -> ``"1000"``."""
    for suffix, unit in (("m", 1024**2), ("k", 1024)):
        if count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)


def suggest(word: str, choices: typing.Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


_hints = functools.cache(typing.get_type_hints)


def check_fields(obj: Any, section: str) -> None:
    """Check and normalise every field of ``obj`` in place (ConfigError keyed section.field)."""
    hints = _hints(type(obj))
    for field in dataclasses.fields(obj):
        key = f"{section}.{field.name}"
        value = getattr(obj, field.name)
        new = coerce(key, hints[field.name], value, unit=field.metadata.get("unit"))
        object.__setattr__(obj, field.name, new)
        low, note = field.metadata.get("min", (None, ""))
        if low is not None and new is not None:
            shown = "≥ 0" if low == 0 else f"at least {low}"
            require(new >= low, key, f"is {new} but must be {shown}{note}")


def coerce(key: str, annotation: Any, value: Any, *, unit: str | None = None) -> Any:
    """``value`` converted to ``annotation`` (``unit``: "tokens" or "bytes" sizes), or ConfigError."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        *others, inner = [a for a in args if a is not type(None)]
        if str in others and isinstance(value, str):  # str | float: a string stays one
            return value
        return coerce(key, inner, value, unit=unit)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ConfigError(f"{key} is {value!r} but must be one of {choices}"
                          f"{suggest(value, [str(a) for a in args])}", key=key)
    if origin is tuple:
        return _coerce_tuple(key, args, value)
    if annotation is int:
        return _to_int(key, value, unit)
    if annotation is float:
        return _to_float(key, value)
    if annotation not in _EXACT:
        raise TypeError(f"config field {key} has an unsupported annotation {annotation!r}")
    if not isinstance(value, annotation):
        raise _fail(key, _EXACT[annotation], value)
    return value


def _fail(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{key} must be {expected}, got {value!r} ({type(value).__name__})", key=key)


_UNITS = {"tokens": (parse_size, " or a size such as 64k"),
          "bytes": (parse_memory, " of bytes or a size such as 240GiB")}
"""unit -> (parser of a size string, how the error message says what is expected)."""


def _to_int(key: str, value: Any, unit: str | None) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    parse, example = _UNITS.get(unit, (None, ""))
    if parse is not None and isinstance(value, str):
        try:
            return parse(value, what=key)
        except ConfigError as error:  # the loader names the source of a keyed error
            raise ConfigError(str(error), key=key) from None
    raise _fail(key, "a whole number" + example, value)


def _to_float(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _fail(key, "a number", value)
    try:  # a string too: YAML 1.1 reads "3e-3" (no dot) as one
        number = float(value)
    except ValueError:
        raise _fail(key, "a number", value) from None
    if not math.isfinite(number):  # .inf / .nan (or "inf", "nan") would train on nonsense
        raise ConfigError(f"{key} is {value!r} but must be a finite number", key=key)
    if abs(number) > FLOAT32_MAX:  # finite here, inf in the float32 the training runs in
        raise ConfigError(f"{key} is {value!r}, which overflows float32 (at most {FLOAT32_MAX:.4g} "
                          "in size), the precision training computes in", key=key)
    return number


_EXACT = {bool: "true or false", str: "a string", dict: "a mapping"}
"""Types taken only as they are -> how an error says what is expected."""


def _coerce_tuple(key: str, args: tuple, value: Any) -> tuple:
    if len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
        if isinstance(value, str) and "," in value:  # names written as the shell's a,b
            raise ConfigError(f"{key} is {value!r}, which is one name; write several as a "
                              f"list: {key}=[{value}]", key=key)
        if isinstance(value, str):  # one name is a list of one
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise _fail(key, "a list", value)
        return tuple(coerce(f"{key}[{i}]", args[0], v) for i, v in enumerate(value))
    if not isinstance(value, (list, tuple)) or len(value) != len(args):
        raise _fail(key, f"a list of {len(args)} values", value)
    return tuple(coerce(f"{key}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))


def require(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError(f"{key} {message}", key=key)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{key} {message}", key=key)
