"""User-facing errors.

A :class:`DdpkitError` is a mistake the user can fix (bad flag, missing file, corrupt
data, conflicting run dir). The CLI prints its message on one line and exits with
status 2; it never shows a traceback for these. Anything else is a bug and keeps its
traceback.
"""


class DdpkitError(Exception):
    """A problem with the user's input, reported as one line and exit status 2."""


class ConfigError(DdpkitError):
    """An invalid flag or config value."""


class DataError(DdpkitError):
    """A dataset that is missing, corrupt or inconsistent."""


class RunDirError(DdpkitError):
    """A run directory that cannot be used as asked (e.g. it holds another config)."""
