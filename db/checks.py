"""Checks for the values handed to the repository functions, before they reach the database.

The database's own constraints (NOT NULL, CHECK, foreign keys) stay as the last line of defence, but their
errors arrive at flush time, name a constraint instead of a value, and differ between SQLite and PostgreSQL.
These checks run first and raise `InvalidRecord`, which names the field, the value and the fix:

    >>> check_nonneg_int("reshard.bytes_moved", -1)
    Traceback (most recent call last):
    ...
    db.checks.InvalidRecord: reshard.bytes_moved: must be an integer >= 0 (got -1). Fix: pass a Python int >= 0
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any


class InvalidRecord(ValueError):
    """A value that cannot be recorded; names the field, the value and what to pass instead."""

    def __init__(self, field: str, value: object, problem: str, fix: str):
        self.field, self.value, self.problem, self.fix = field, value, problem, fix
        super().__init__(f"{field}: {problem} (got {value!r}). Fix: {fix}")


def check_int(field: str, value: object, *, minimum: int | None = None) -> int:
    # bool is an int to Python, never a count or an id to us.
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise InvalidRecord(field, value, f"must be an integer{bound}", f"pass a Python int{bound}")
    return value


def check_nonneg_int(field: str, value: object) -> int:
    return check_int(field, value, minimum=0)


def check_float(field: str, value: object, *, minimum: float | None = None, maximum: float | None = None,
                optional: bool = False) -> float | None:
    """A finite number within the bounds (inclusive); ints are accepted and stored as floats."""
    if value is None and optional:
        return None
    bounds = " and ".join(b for b in (f">= {minimum}" if minimum is not None else "",
                                      f"<= {maximum}" if maximum is not None else "") if b)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None and value < minimum:  # type: ignore[operator]
        ok = False
    if ok and maximum is not None and value > maximum:  # type: ignore[operator]
        ok = False
    if not ok:
        want = f"a finite number{' ' + bounds if bounds else ''}" + (" or None" if optional else "")
        raise InvalidRecord(field, value, f"must be {want}", f"pass {want}")
    return float(value)  # type: ignore[arg-type]


def check_str(field: str, value: object, *, max_len: int | None = None, optional: bool = False) -> str | None:
    """A non-empty string (no longer than the column allows)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip() or (max_len is not None and len(value) > max_len):
        limit = f" of at most {max_len} characters" if max_len is not None else ""
        raise InvalidRecord(field, value, f"must be a non-empty string{limit}" + (" or None" if optional else ""),
                            f"pass a short descriptive string{limit}")
    return value


def check_one_of(field: str, value: object, allowed: Sequence[str]) -> str:
    """One of `allowed`; a str-valued enum member (e.g. `tidal.core.devices.Owner.ACTOR`) counts as its value."""
    raw = value.value if isinstance(value, enum.Enum) else value
    if raw not in allowed:
        raise InvalidRecord(field, value, "is not an allowed value", f"pass one of {list(allowed)}")
    return raw  # type: ignore[return-value]


def check_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidRecord(field, value, "must be True or False", "pass a bool")
    return value


def check_devices(field: str, value: object) -> list[int]:
    """Device ids: a sequence of distinct non-negative ints, stored in the given order."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidRecord(field, value, "must be a list of device ids", "pass e.g. [0, 1, 2]")
    ids = [check_nonneg_int(f"{field}[{i}]", d) for i, d in enumerate(value)]
    if len(set(ids)) != len(ids):
        raise InvalidRecord(field, value, "repeats a device id", "list each device once")
    return ids


def check_json_object(field: str, value: object) -> dict[str, Any]:
    """A JSON object: a str-keyed mapping, or a dataclass instance (converted with `dataclasses.asdict`).

    Round-trips through `json` so that what is stored is exactly what a later read returns (tuples become
    lists, str-valued enum members become their values).
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidRecord(field, value, "must be a mapping with string keys (a JSON object)",
                            "pass a dict such as {'tp': 2, 'dp': 1, 'devices': [0, 1]}")
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidRecord(field, value, f"is not JSON-serialisable ({exc})",
                            "use only str keys and str/int/float/bool/None/list/dict values, no NaN") from None


def check_phase_seconds(field: str, value: object) -> dict[str, float]:
    """Phase name -> seconds spent in it (finite, >= 0)."""
    obj = check_json_object(field, value)
    return {k: check_float(f"{field}[{k!r}]", v, minimum=0.0) for k, v in obj.items()}  # type: ignore[misc]
