"""What the driver knows of a run's devices and of the step in progress: `Cluster` (components by device, the
calls in flight, the event record) and `StepState` (the step's work and its measurements).

One owner each: the driver (`tidal.pipeline.driver.Pipeline`) feeds work and handles results; the actuator
(`tidal.pipeline.actuator.RayActuator`) changes which device hosts which component. Both record events here.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from tidal.core.devices import DeviceLedger
from tidal.engine.layout import Layout
from tidal.engine.records import RolloutGroup, ScoredGroup
from tidal.pipeline.timeline import Timeline
from tidal.workers import roles
from tidal.workers.device_worker import WorkerFn
from tidal.workers.messages import RolloutReport
from tidal.workers.roles import ROLLOUT_INTERRUPT
from tidal.workers.runtime import CallHandle, WorkerGroup

log = logging.getLogger("tidal.pipeline")


class CallKind(Enum):
    """What a call in flight does, so its result goes to the right handler of the driver."""

    ROLLOUT = "rollout"      #: a rollout time slice -> (finished groups, RolloutReport)
    INFERENCE = "inference"  #: scoring (payload: the groups) -> scored groups
    ACTOR = "actor"          #: one rank's part of an actor iter -> its metrics (None outside the layout)


@dataclass
class Flight:
    """A call in flight: what it is, on which device, when it started."""

    kind: CallKind
    device: int
    handle: CallHandle
    t0: float
    payload: Any = None


@dataclass
class StepState:
    """What the driver knows during one step (rebuilt each step)."""

    step: int
    queue: deque
    num_groups: int
    groups: dict[int, Any] = field(default_factory=dict)   # group id -> its PromptGroup (regenerated if lost)
    given: dict[int, int] = field(default_factory=dict)          # instance -> groups handed out, not emitted
    total_given: dict[int, int] = field(default_factory=dict)    # instance -> sequences ever given this step
    reports: dict[int, RolloutReport] = field(default_factory=dict)   # instance -> its last slice report
    to_score: list[RolloutGroup] = field(default_factory=list)
    scoring: int = 0
    scored: dict[int, ScoredGroup] = field(default_factory=dict)
    gen_time: dict[int, float] = field(default_factory=dict)     # group id -> when it came back generated
    score_time: dict[int, float] = field(default_factory=dict)   # group id -> when it came back scored
    t_start: float = 0.0
    generated: int = 0
    iters_done: int = 0
    iter_running: bool = False
    last_iter_s: float = 0.0
    held: bool = False
    actor_metrics: list[dict] = field(default_factory=list)
    iter_ranks: list[dict] = field(default_factory=list)   # the running iter's per-rank reports
    # (mean batch, wall seconds per decode step) of every rollout call that generated: the decode cost, measured
    decode_samples: list[tuple[float, float]] = field(default_factory=list)
    # seconds per engine pump (admit + one decode step) inside the instance, per rollout call: the devices' own
    # speed, whatever the driver and the policy do (the machine's drift, for comparing runs)
    pump_samples: list[float] = field(default_factory=list)
    # (groups, tokens, wall seconds) of every scoring call: the scoring cost, measured
    score_samples: list[tuple[int, float, float]] = field(default_factory=list)
    # (tp, dp, tokens, wall seconds) of every actor iter: its cost per layout, measured
    iter_samples: list[tuple[int, int, float, float]] = field(default_factory=list)
    iter_tokens: float = 0.0
    # rollout instances' time the driver can see: seconds their calls spent generating (`busy_s`), their calls'
    # wall time (submit -> result), and the gaps in which an instance held work but had no call to run it
    rollout_busy_s: float = 0.0
    rollout_call_s: float = 0.0
    rollout_gap_s: float = 0.0
    rollout_gc_s: float = 0.0    # the instances' garbage-collector pauses, summed
    reward_timeouts: int = 0     # reward calls cut by reward.timeout_s (scored 0)
    # the step's work in padded tokens, a function of the data (not of model.max_seq_len or the layout):
    # actor micro-batches (rows x width), scoring batches, decode key positions read, prefill tokens
    work: dict[str, float] = field(default_factory=dict)
    # shared placements (tidal.pipeline.sharing): the step's hand-over to training and its KV release are done
    handed_over: bool = False
    kv_freed: bool = False
    waiting_since: dict[int, float] = field(default_factory=dict)   # instance -> since when it holds work, no call
    last_result: dict[int, float] = field(default_factory=dict)     # instance -> when its last call came back


class Cluster:
    """The actuation surface: devices by id, components, and the moves the scheduler may ask for."""

    def __init__(self, group: WorkerGroup, ledger: DeviceLedger, timeline: Timeline, clock: Callable[[], float],
                 actor_layout: Layout, rollout: tuple[int, ...], inference: tuple[int, ...]):
        self.group, self.ledger, self.timeline, self.clock = group, ledger, timeline, clock
        self.actor_layout = actor_layout
        self.rollout: list[int] = list(rollout)       # instance id == its device id (rollout TP 1)
        self.inference: list[int] = list(inference)
        self.lent: set[int] = set()                   # rollout instances running on actor devices
        self.inflight: dict[Any, Flight] = {}
        self.slice_seq: dict[int, int] = {}          # device -> number of its last rollout slice
        self.events: list[dict] = []

    # ---- calls -------------------------------------------------------------------------------------------
    def submit(self, kind: CallKind, device: int, fn: WorkerFn, payload: Any = None, **kwargs) -> Flight:
        f = Flight(kind, device, self.group.submit(device, fn, **kwargs), self.clock(), payload)
        self.inflight[f.handle.ref] = f
        return f

    def submit_slice(self, device: int, groups: list, budget_s: float) -> Flight:
        """A rollout time slice, numbered per device: an interrupt names the last number it ends, so every slice
        queued by then ends and none submitted later does."""
        self.slice_seq[device] = seq = self.slice_seq.get(device, -1) + 1
        return self.submit(CallKind.ROLLOUT, device, roles.rollout_run, groups=groups, budget_s=budget_s, seq=seq)

    def busy(self, device: int) -> bool:
        return any(f.device == device for f in self.inflight.values())

    def calls(self, device: int, kind: CallKind) -> int:
        return sum(f.device == device and f.kind == kind for f in self.inflight.values())

    def wait_any(self, timeout: float) -> list[tuple[Flight, Any]]:
        import ray  # imported late: Ray reads its environment (loopback, auth) at import time
        if not self.inflight:
            return []
        ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=timeout)
        out = []
        for ref in ready:
            f = self.inflight[ref]
            res = self.group.gather([f.handle])[0]   # raises WorkerDied with the call still here, for recovery
            del self.inflight[ref]
            out.append((f, res))
        return out

    def drain(self, handle: Callable[[Flight, Any], None], devices: set[int] | None = None) -> None:
        """Wait for calls in flight (on `devices`, or all) and hand their results to `handle`. Rollout time
        slices among them are interrupted first: they end after the engine pump in progress instead of running
        out their slice (up to `slice_s`, 0.1 s, per migration wave on the critical path otherwise)."""
        slices = sorted({f.device for f in self.inflight.values()
                         if f.kind is CallKind.ROLLOUT and (devices is None or f.device in devices)})
        if slices:   # by number: the slice running and the one queued behind it both end (see `submit_slice`)
            self.group.interrupt({d: self.slice_seq[d] for d in slices}, ROLLOUT_INTERRUPT)
        while any(devices is None or f.device in devices for f in self.inflight.values()):
            for f, res in self.wait_any(1.0):
                handle(f, res)

    def record(self, kind: str, **fields) -> dict:
        ev = {"kind": kind, "time": self.clock(), **fields}
        self.events.append(ev)
        log.info("%s %s", kind, {k: v for k, v in fields.items() if k != "kind"})
        return ev


