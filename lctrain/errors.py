"""Errors that speak to the user: a :class:`UserError` is one sentence naming the value, the
limit and the fix, printed by the CLI without a traceback; any other exception is a bug."""
from __future__ import annotations

import errno


class UserError(Exception):
    """A mistake the user can fix; ``str(error)`` is the whole message."""


class ConfigError(UserError, ValueError):
    """A recipe, override or command-line value is invalid; ``key``: the recipe key at fault."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class DataError(UserError):
    """The training data cannot be found, read or packed."""


_ENVIRONMENT_ERRNOS = {errno.ENOSPC: "free space on that disk", errno.EDQUOT: "free space on that disk",
                       errno.EACCES: "fix its permissions", errno.EPERM: "fix its permissions",
                       errno.EROFS: "choose a writable disk"}
"""Operating-system errors that are the machine's state, not a bug → the fix to suggest."""


def environment_error(error: BaseException) -> UserError | None:
    """A full disk, a missing permission or a read-only file system as one sentence naming the
    file; None for any other error."""
    if not isinstance(error, OSError) or error.errno not in _ENVIRONMENT_ERRNOS:
        return None
    where = f" ({error.filename})" if error.filename else ""
    return UserError(f"{error.strerror or type(error).__name__}{where}; "
                     f"{_ENVIRONMENT_ERRNOS[error.errno]}, or choose another train.output_dir.")


def as_user_error(error: BaseException) -> UserError | None:
    """``error`` as a UserError — itself, a machine state (`environment_error`) or a missing
    attention backend — or None for a bug."""
    if isinstance(error, UserError):
        return error
    found = environment_error(error)
    if found is not None:
        return found
    try:
        from lctrain_kernels.api import BackendUnavailable
    except ImportError:
        return None
    return UserError(str(error)) if isinstance(error, BackendUnavailable) else None


def first_line(exc: BaseException) -> str:
    """An exception's first line without its final period, or its type name."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__
