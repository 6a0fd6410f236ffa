"""The state of one conversion: the resolved RLinf leaves, the Tidal mapping being built, what was carried and
dropped with which reason, and the checked readers (`as_int`, `as_float`, ...) the mapping steps use."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.convert.interpolation import Unresolved
from tidal.convert.keys import NULL, pattern_reason, reason
from tidal.core.errors import ConfigError


@dataclass(frozen=True)
class Dropped:
    key: str       # dotted RLinf key (`defaults[1]` for a defaults-list entry)
    reason: str    # why it could not be carried


@dataclass(frozen=True)
class Carried:
    key: str       # dotted RLinf key
    target: str    # dotted Tidal key it was carried to


ABSENT = object()   # a key that is not in the RLinf config
_INT = re.compile(r"[+-]?\d+(?:_\d+)*")
_FLOAT = re.compile(r"[+-]?(?:\d+(?:_\d+)*\.\d*|\.\d+|\d+(?:_\d+)*)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)", re.I)


def leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(leaves(v, key))
        else:
            out[key] = v
    return out



class Builder:
    def __init__(self, resolved: dict, field: str):
        self.tree, self.field = resolved, field
        self.leaves = leaves({k: v for k, v in resolved.items() if k != "defaults"})
        self.out: dict[str, dict] = {}
        self.carried: list[Carried] = []
        self.reasons: dict[str, str] = {}
        self.notes: list[str] = []

    # -- reading

    def take(self, key: str) -> Any:
        """The leaf's value, ABSENT if the key is not there; raises if Tidal needs it and it did not resolve."""
        if key not in self.leaves:
            return ABSENT
        v = self.leaves[key]
        if isinstance(v, Unresolved):
            raise v.error
        return v

    def subtree(self, key: str) -> Any:
        node: Any = self.tree
        for seg in key.split("."):
            if not isinstance(node, dict) or seg not in node:
                return ABSENT
            node = node[seg]
        return node

    def err(self, key: str, value: Any, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{self.field}: {key}", value, problem, fix)

    def as_int(self, v: Any, key: str) -> int:
        if isinstance(v, bool):
            raise self.err(key, v, "must be an integer", "write a whole number")
        if isinstance(v, int):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str) and _INT.fullmatch(v.strip()):
            return int(v.strip().replace("_", ""))
        raise self.err(key, v, "must be an integer", "write a whole number")

    def as_float(self, v: Any, key: str) -> float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str) and _FLOAT.fullmatch(v.strip()):   # yaml.safe_load reads 2e-05 as text
            return float(v.strip().replace("_", ""))
        raise self.err(key, v, "must be a number", "write a number such as 2.0e-05")

    def as_bool(self, v: Any, key: str) -> bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            return v.strip().lower() == "true"
        raise self.err(key, v, "must be true or false", "write true or false")

    def as_str(self, v: Any, key: str) -> str:
        if isinstance(v, (dict, list)) or v is None:
            raise self.err(key, v, "must be text", "write a plain string")
        return str(v)

    # -- writing

    def put(self, target: str, value: Any) -> None:
        section, name = target.split(".", 1)
        self.out.setdefault(section, {})[name] = value

    def carry(self, key: str, target: str, value: Any = ABSENT) -> None:
        if value is not ABSENT:
            self.put(target, value)
        self.carried.append(Carried(key, target))

    def drop(self, key: str, reason: str) -> None:
        if key in self.leaves or key.startswith("defaults["):
            self.reasons.setdefault(key, reason)

    def simple(self, key: str, target: str, conv: Callable[[Any, str], Any],
               check: Callable[[Any], str | None] | None = None) -> Any:
        """Carry `key` to `target` through `conv`; null is dropped; `check` may refuse a value (returns why)."""
        v = self.take(key)
        if v is ABSENT:
            return ABSENT
        if v is None:
            self.drop(key, NULL)
            return ABSENT
        value = conv(v, key)
        why = check(value) if check else None
        if why:
            self.drop(key, f"value not supported: {why}")
            return ABSENT
        self.carry(key, target, value)
        return value

    def result(self) -> tuple[tuple[Dropped, ...], tuple[Carried, ...]]:
        carried_keys = {c.key for c in self.carried}
        dropped = [Dropped(k, r) for k, r in self.reasons.items() if k.startswith("defaults[")]
        for key, value in self.leaves.items():
            if key in self.reasons:
                dropped.append(Dropped(key, self.reasons[key]))
            elif key not in carried_keys:
                if isinstance(value, Unresolved):
                    dropped.append(Dropped(key, f"could not be resolved ({value.error.problem}); "
                                                f"{pattern_reason(key)}"))
                else:
                    dropped.append(Dropped(key, reason(key, value)))
        order = {k: i for i, k in enumerate(self.leaves)}
        carried = sorted(self.carried, key=lambda c: order.get(c.key, len(order)))
        return tuple(dropped), tuple(carried)


def positive(v: Any) -> str | None:
    return None if v >= 1 else "Tidal needs a value of at least 1"

