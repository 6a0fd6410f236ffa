"""User-facing errors: each names the field, the value and the fix.

The CLI turns a `TidalError` into one message on stderr and exit code 2; nothing else in the package
prints tracebacks for bad input. Asserts stay for our own invariants.
"""

from __future__ import annotations

from tidal.core.secrets import redact

SHOWN_VALUE_CHARS = 200   # an error shows at most this much of the value it refuses


def shown(value: object) -> str:
    """`repr(value)` as an error prints it: credentials masked, cut to SHOWN_VALUE_CHARS."""
    text = redact(repr(value))
    return text if len(text) <= SHOWN_VALUE_CHARS else f"{text[:SHOWN_VALUE_CHARS]}... ({len(text):,} chars)"


class TidalError(Exception):
    """Bad input from the user: a config key, a CLI flag, a file. Exit code 2."""

    exit_code = 2

    def __init__(self, field: str, value: object, problem: str, fix: str):
        self.field, self.value, self.problem, self.fix = field, value, problem, fix
        super().__init__(f"{field}: {problem} (got {shown(value)}). Fix: {fix}")

    def __reduce__(self) -> tuple[type[TidalError], tuple[str, object, str, str]]:
        # Exception's default reduce re-calls cls(*self.args) with the one formatted message: an error raised on
        # a worker would not survive the trip to the driver. Every subclass keeps this four-field constructor.
        return (type(self), (self.field, self.value, self.problem, self.fix))

    def on_device(self, device_id: int, rank: int) -> TidalError:
        """The same error, of the same type, saying which device (and world rank) raised it."""
        return type(self)(self.field, self.value, f"{self.problem} [raised on device {device_id}, rank {rank}]",
                          self.fix)


class ConfigError(TidalError):
    """A config file or override that cannot describe a valid run."""


class PeerFailed(TidalError):
    """Raised by a rank only because another rank of the same collective failed: whoever collects the ranks'
    results reports that other rank's error, the cause, instead."""


class TrainingError(TidalError):
    """A run that cannot go on as configured (a non-finite gradient norm with actor.on_nonfinite: stop)."""


class LayoutError(TidalError):
    """An actor layout that cannot exist (TP that does not divide heads, more ranks than devices...)."""
