"""What every command shares: user errors as one sentence, and libraries not built yet."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import typer
from typer.core import TyperGroup

from lctrain.errors import as_user_error

USER_ERROR_EXIT = 1
"""Exit code of a user mistake (bad recipe, size, path, ...)."""


UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
"""Click's usage error (Typer's `typer.BadParameter` is one; Typer may carry its own Click)."""


class OneLineUsage(TyperGroup):
    """The app's group: a mistake in the command line itself (an unknown command or option, a
    missing argument, a value of the wrong kind) is one line on stderr with the command's
    ``--help`` to read, and exit code 2, instead of the usage block Click prints.

    Every command runs inside the group's ``invoke`` (subcommand groups such as ``bench``
    too), so one place covers them all; a bare ``lctrain`` or ``lctrain bench`` still prints
    the help.
    """

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except UsageError as error:
            raise _usage_exit(error) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as error:
            raise _usage_exit(error, ctx) from None


def _usage_exit(error, ctx=None) -> Exception:
    """Print the usage error ``error`` as one sentence naming the command's --help; return the
    exception to raise (the error itself where no arguments were given: that shows the help).

    An error without a context (an option missing its value) names the subcommand the group
    ``ctx`` was running, else the program."""
    if type(error).__name__ == "NoArgsIsHelpError":
        return error
    if error.ctx is not None:
        command = error.ctx.command_path
    elif ctx is not None:
        command = " ".join(filter(None, (ctx.command_path, ctx.invoked_subcommand)))
    else:
        command = "lctrain"
    message = " ".join(error.format_message().split()).rstrip(".")
    typer.echo(f"error: {message}; see {command} --help", err=True)
    return typer.Exit(error.exit_code)


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
