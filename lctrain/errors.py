"""Errors that speak to the user.

Anything the user can fix (a bad recipe, an impossible size, a missing file, an offline hub)
raises a subclass of :class:`UserError` whose message is one sentence naming the value, the limit
and the fix. The CLI prints that sentence on stderr and exits non-zero, without a traceback; any
other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; ``str(error)`` is the whole message."""


class ConfigError(UserError, ValueError):
    """A recipe, an override or a command-line value is invalid.

    ``key`` is the dotted recipe key at fault (e.g. ``"train.lr"``) when there is one, so that the
    loader can say where the value came from (the recipe file or a ``--set`` override).
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class DataError(UserError):
    """The training data cannot be found, read or packed."""
