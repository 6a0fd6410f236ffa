"""Seconds this process spent in Python's cyclic garbage collector, and a way to keep the collector off hot paths.

    pauses = GcPauses.install()     # once per process; idempotent
    ...
    pauses.take()                   # -> (seconds, longest pause, collections) since the last take

Why: a full (generation 2) collection of a process holding a model, an engine and Ray's objects scans every
container object it has: a driver pauses 0.12-0.18 s about once every 7 steps of the CPU e2e workload, and a
reshard can take 0.2 s while its workers work 0.03 s; the pauses are recorded per step and per reshard to tell
the two apart. `freeze()` moves everything alive now (the model,
the engine, imported modules) into the permanent generation, which later collections do not scan: objects made
once at setup stop costing every collection. Objects freed by reference counting are freed as before; only
cycles among frozen objects stay until the process ends.
"""

from __future__ import annotations

import gc
import threading
import time


class GcPauses:
    _installed: GcPauses | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._t0: float | None = None
        self.seconds = 0.0
        self.longest = 0.0
        self.collections = 0

    @classmethod
    def install(cls) -> GcPauses:
        """The process's timer (registered with `gc.callbacks` on first use)."""
        if cls._installed is None:
            cls._installed = cls()
            gc.callbacks.append(cls._installed._callback)
        return cls._installed

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            dt = time.perf_counter() - self._t0
            self._t0 = None
            with self._lock:
                self.seconds += dt
                self.longest = max(self.longest, dt)
                self.collections += 1

    def take(self) -> tuple[float, float, int]:
        """(seconds paused, longest pause, collections) since the last call; resets them."""
        with self._lock:
            out = (self.seconds, self.longest, self.collections)
            self.seconds, self.longest, self.collections = 0.0, 0.0, 0
        return out

    @staticmethod
    def freeze() -> None:
        """Collect once, then move every object alive into the permanent generation (see module doc)."""
        gc.collect()
        gc.freeze()
