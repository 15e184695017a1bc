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


def as_user_error(error: BaseException) -> UserError | None:
    """``error`` as a UserError — itself, a machine state (a full disk, a missing permission or
    a read-only file system: one sentence naming the file) or a missing attention backend — or
    None for a bug."""
    if isinstance(error, UserError):
        return error
    if isinstance(error, OSError) and error.errno in _ENVIRONMENT_ERRNOS:
        where = f" ({error.filename})" if error.filename else ""
        return UserError(f"{error.strerror or type(error).__name__}{where}; "
                         f"{_ENVIRONMENT_ERRNOS[error.errno]}, or choose another train.output_dir.")
    try:
        from lctrain_kernels.api import BackendUnavailable
    except ImportError:
        return None
    return UserError(str(error)) if isinstance(error, BackendUnavailable) else None


def unwritable(what: str, error: OSError) -> UserError:
    """``what`` (a folder named with its role) cannot be written, with the system's reason."""
    return UserError(f"{what} cannot be written ({error.strerror or type(error).__name__}); "
                     "choose a folder you may write to, on a disk with free space.")


def first_line(exc: BaseException) -> str:
    """An exception's first line without its final period, or its type name."""
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__
