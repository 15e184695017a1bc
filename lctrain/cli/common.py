"""What every command shares: user errors as one sentence, and libraries not built yet."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer

from lctrain.errors import as_user_error

USER_ERROR_EXIT = 1
"""Exit code of a user mistake (bad recipe, size, path, ...)."""


def is_user_error(error: BaseException) -> bool:
    """True for mistakes the user can fix (`lctrain.errors.as_user_error`)."""
    return as_user_error(error) is not None


def fail(message: str, code: int = USER_ERROR_EXIT) -> typer.Exit:
    """Print ``message`` as one line on stderr and return the Exit to raise."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    return typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn user errors raised inside the block into one sentence on stderr and exit code 1;
    anything else is a bug and keeps its traceback."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - filtered right below
        mistake = as_user_error(error)
        if mistake is None:
            raise
        raise fail(str(mistake)) from None


def as_json(payload: Any) -> str:
    """A result's ``to_json()`` output (a dict or an already-encoded string) as JSON text."""
    return payload if isinstance(payload, str) else json.dumps(payload, indent=2, default=str)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path``, creating its folder."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")


def split_names(text: str | None) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; None stays None."""
    if text is None:
        return None
    return [item.strip() for item in text.split(",") if item.strip()]
