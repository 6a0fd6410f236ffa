"""A failed device comes back: a replacement worker is started for it, and once it answers it rejoins the free pool.

::

    device FAILED (tidal.pipeline.faults) ──► Rejoin.start: group.replace(d), a new process; returns at once
    each look of the step's loop (every 0.5 s) and at the step end: Rejoin.poll, never waiting
        replacement up? group.replacement_ready(d): compute share and pinning applied, a context of its own,
                        a health answer
          └─► roles.setup(spec) submitted ─► done? ─► ledger.rejoin(d): FAILED -> FREE, a `device_rejoined` event
    a FREE device is what the policies hand out (StartRollout) and what the step end's restore puts back in its
    initial role; its engine then loads the current weights (the weight sync, or `Generations.weights_for`)

A replacement is in no world (torch's world has a fixed size; `DeviceWorker.init_alone`), so it serves rollout and
inference, never the actor: actor calls go to `WorkerGroup.world_ids`, and a reshard onto a device outside the
world is refused. A replacement that cannot start (no GPU free) stays pending and the run goes on without it;
one that dies starting leaves the device FAILED, with a warning.

`device_rejoined` carries `seconds` (failure -> FREE again), `start_s` (the replacement's process start),
`setup_s` (its run setup), `bytes` (what was sent to it: the pickled run spec; its weights come with the next
weight sync, as to any engine) and the replacement's `pid`.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass

from tidal.core.devices import DeviceFailure, DeviceLedger
from tidal.pipeline.cluster import Cluster
from tidal.workers.errors import WorkerDied
from tidal.workers.roles import RunSpec
from tidal.workers.runtime import CallHandle

log = logging.getLogger("tidal.pipeline")


@dataclass
class Replacement:
    """A replacement worker on its way: the failure it answers, when it was asked for, its setup call."""

    failure: DeviceFailure
    started_at: float
    up_at: float | None = None
    pid: int | None = None
    setup: CallHandle[int] | None = None


class Rejoin:
    """Replacement workers for FAILED devices, from start to the free pool."""

    def __init__(self, c: Cluster, ledger: DeviceLedger, spec: RunSpec):
        self.c, self.ledger, self.spec = c, ledger, spec
        self.pending: dict[int, Replacement] = {}

    def start(self, failure: DeviceFailure) -> None:
        """Ask for a replacement worker for `failure.device` (retired by the recovery)."""
        self.c.group.replace(failure.device)
        self.pending[failure.device] = Replacement(failure, self.c.clock())

    def poll(self, step: int) -> list[int]:
        """Move each replacement on as far as it can go without waiting; returns the devices that rejoined now."""
        c, g = self.c, self.c.group
        back = []
        for d, r in list(self.pending.items()):
            try:
                if r.setup is None:
                    info = g.replacement_ready(d)
                    if info is None:
                        continue
                    r.up_at, r.pid = c.clock(), info.pid
                    r.setup = c.endpoints.worker.setup([d], self.spec)[0]
                if not g.done(r.setup):
                    continue
                g.gather([r.setup])
            except WorkerDied as died:
                del self.pending[d]
                log.warning("device %d stays failed: %s", d, died.reason)
                continue
            del self.pending[d]
            now = c.clock()
            why = f"replacement worker (pid {r.pid}) answers"
            self.ledger.rejoin(d, why)
            c.record("device_rejoined", step=step, device=d, role=r.failure.role.value, pid=r.pid, reason=why,
                     seconds=now - r.failure.time, start_s=(r.up_at or now) - r.started_at,
                     setup_s=now - (r.up_at or now), bytes=len(pickle.dumps(self.spec)))
            back.append(d)
        return back

    def wait(self, step: int, timeout_s: float, poll_s: float = 0.2) -> list[int]:
        """`poll` until no replacement is pending or `timeout_s` passed; returns the devices that rejoined. For
        callers between steps (tests, benchmarks): the run itself never waits for a replacement."""
        deadline, back = time.monotonic() + timeout_s, []
        while True:
            back += self.poll(step)
            if not self.pending or time.monotonic() >= deadline:
                return back
            time.sleep(poll_s)
