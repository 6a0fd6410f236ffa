"""Process-local registry of live objects (open training runs, open sweeps), keyed by a short string id.

Prefect pickles task results and may persist them, so tasks pass ids, never tensors or worker handles. The
object itself (a `TrainingRun` holding its Ray workers) lives in the flow run's process; every task of that
flow run (threads of the same process) looks it up here::

    key = registry.put("run", open_run)        # "run-3f2a9c1e"
    registry.get(key, "run")                     # the same object, in any task of this process
    registry.pop(key)                            # when the run is closed

A key from another process (a retried flow run on another worker) is not here: `get` says so rather than
returning something else.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

_lock = threading.Lock()
_objects: dict[str, Any] = {}


def put(kind: str, obj: Any, key: str | None = None) -> str:
    key = key or f"{kind}-{uuid.uuid4().hex[:8]}"
    with _lock:
        if key in _objects:
            raise KeyError(f"registry key {key!r} is already taken by a live {kind}")
        _objects[key] = obj
    return key


def get(key: str, kind: str | None = None) -> Any:
    with _lock:
        obj = _objects.get(key)
    if obj is None or (kind is not None and not key.startswith(f"{kind}-")):
        raise LookupError(f"no live {kind or 'object'} {key!r} in this process (live: {sorted(_objects)}); "
                          "tasks of one flow run share its process: run the whole flow again")
    return obj


def pop(key: str) -> Any | None:
    with _lock:
        return _objects.pop(key, None)


def live() -> list[str]:
    with _lock:
        return sorted(_objects)
