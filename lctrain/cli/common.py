"""What every command shares: user errors as one sentence, and libraries not built yet."""
from __future__ import annotations

import importlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import typer

from lctrain.errors import UserError

USER_ERROR_EXIT = 1
"""Exit code of a user mistake (bad recipe, size, path, ...)."""
NOT_AVAILABLE_EXIT = 2
"""Exit code of a command whose library is not part of this build yet."""


def is_user_error(error: BaseException) -> bool:
    """True for mistakes the user can fix: UserError, and the kernels' BackendUnavailable
    (lctrain_kernels must not depend on lctrain, so it has its own exception)."""
    if isinstance(error, UserError):
        return True
    try:
        from lctrain_kernels.backends import BackendUnavailable
    except ImportError:
        return False
    return isinstance(error, BackendUnavailable)


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
        if not is_user_error(error):
            raise
        raise fail(str(error)) from None


def library(module: str, name: str, command: str) -> Callable[..., Any]:
    """``module.name``, or exit 2 saying the command is not yet available when the module (or
    the name in it) does not exist in this build. Missing dependencies of an existing module are
    NOT hidden: they raise as usual."""
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or not (module == error.name or module.startswith(error.name + ".")):
            raise
        found = None
    function = getattr(found, name, None)
    if function is None:
        raise fail(f"lctrain {command} is not yet available in this build ({module}.{name} is "
                   f"missing)", NOT_AVAILABLE_EXIT)
    return function


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
