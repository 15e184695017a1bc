"""What every command shares: user errors and command-line mistakes as one sentence."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import typer
from typer.core import TyperGroup

from lctrain.errors import as_user_error

# Click's usage error (Typer's BadParameter is one; Typer may carry its own Click)
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class OneLineUsage(TyperGroup):
    """The app's group: a command-line mistake is one line naming ``--help`` (exit code 2)."""

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
    """Print ``error`` as one sentence naming --help; the exception to raise."""
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


@contextmanager
def user_errors() -> Iterator[None]:
    """A user error in the block is one line on stderr and exit code 1; bugs keep a traceback."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - filtered right below
        mistake = as_user_error(error)
        if mistake is None:
            raise
        typer.echo(f"error: {' '.join(str(mistake).split())}", err=True)
        raise typer.Exit(1) from None


def split_names(text: str | None) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; None stays None."""
    return None if text is None else [item.strip() for item in text.split(",") if item.strip()]
