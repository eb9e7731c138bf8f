"""Errors that reach the user as one line instead of a traceback."""


class ConfigError(Exception):
    """A user error in the job configuration; reported as one line, exit code 2."""
