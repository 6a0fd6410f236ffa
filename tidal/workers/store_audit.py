"""What crosses Ray's object store, measured: the tensor bytes each value carries.

Tensors move between workers by the transfer layer (`tidal.engine.transfer`), never through Ray: Ray carries
calls' arguments and results and the values the driver `put`s, which must stay small records. Both ends note
every such value by name (the driver: a call's arguments under its function's path, a `put` under "put"; a
worker: its call's result under the function's path), keeping the largest per name, so a test or a run can
state that no step sent more than a bound through the store (`WorkerGroup.store_audit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

#: objects visited per value at most (a step's sample lists hold thousands; a value past this counts as measured)
_MAX_OBJECTS = 200_000


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in `value` (nested lists, tuples, dicts, sets and dataclass or plain objects)."""
    total, seen, stack, visited = 0, set(), [value], 0
    while stack and visited < _MAX_OBJECTS:
        v = stack.pop()
        visited += 1
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, (str, bytes, int, float, bool, type(None))) or id(v) in seen:
            continue
        else:
            seen.add(id(v))
            if isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, (list, tuple, set, frozenset)):
                stack.extend(v)
            elif dataclasses.is_dataclass(v):
                stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
            elif hasattr(v, "__dict__"):
                stack.extend(vars(v).values())
    return total


class StoreAudit:
    """The largest tensor bytes noted per name since the last `take`."""

    def __init__(self) -> None:
        self.largest: dict[str, int] = {}

    def note(self, name: str, value: Any) -> None:
        self.record(name, tensor_bytes(value))

    def record(self, name: str, nbytes: int) -> None:
        if nbytes > self.largest.get(name, -1):
            self.largest[name] = nbytes

    def take(self, reset: bool = True) -> dict[str, int]:
        out = dict(self.largest)
        if reset:
            self.largest = {}
        return out


def merged(audits: list[dict[str, int]]) -> dict[str, int]:
    """The largest per name over several audits."""
    out: dict[str, int] = {}
    for a in audits:
        for k, v in a.items():
            out[k] = max(v, out.get(k, 0))
    return out
