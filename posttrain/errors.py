"""`UserError`: a problem with the run's input that the user can fix (a config key, a path).

Raised where the input is checked; `posttrain.main` prints it as one line and exits non-zero
(the traceback only with `--verbose`). It lives at the bottom of the package so every layer can
raise it.
"""

from __future__ import annotations


class UserError(ValueError):
    """A bad input, named: `key` (config key, e.g. "init_from"), `path` (file or folder) and the
    message saying what was expected and what to do."""

    def __init__(self, message: str, *, key: str | None = None, path: str | None = None):
        super().__init__(message)
        self.key = key
        self.path = path

    def __str__(self) -> str:
        msg = super().__str__()
        if self.key and f"{self.key}" not in msg:
            msg = f"config.{self.key}: {msg}"
        return msg
