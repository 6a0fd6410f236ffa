"""User-facing errors: each names the field, the value and the fix.

The CLI turns a `TidalError` into one message on stderr and exit code 2; nothing else in the package
prints tracebacks for bad input. Asserts stay for our own invariants.
"""

from __future__ import annotations


class TidalError(Exception):
    """Bad input from the user: a config key, a CLI flag, a file. Exit code 2."""

    exit_code = 2

    def __init__(self, field: str, value: object, problem: str, fix: str):
        self.field, self.value, self.problem, self.fix = field, value, problem, fix
        super().__init__(f"{field}: {problem} (got {value!r}). Fix: {fix}")


class ConfigError(TidalError):
    """A config file or override that cannot describe a valid run."""


class LayoutError(TidalError):
    """An actor layout that cannot exist (TP that does not divide heads, more ranks than devices...)."""
