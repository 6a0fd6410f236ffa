"""What the driver knows of a run's devices and of the step in progress: `Cluster` (the calls in flight, the
event record) and `StepState` (the step's work and its measurements).

One owner each: the driver (`tidal.pipeline.driver.Pipeline`) feeds work and handles results; the actuator
(`tidal.pipeline.actuator.RayActuator`) owns the placement (`tidal.pipeline.placement`: which device hosts which
component). Both record events here.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from tidal.core.devices import DeviceLedger
from tidal.engine.records import RolloutGroup, ScoredGroup
from tidal.pipeline.timeline import Timeline
from tidal.workers.endpoints import Endpoints
from tidal.workers.messages import MoveSummary, RolloutReport
from tidal.workers.roles_rollout import ROLLOUT_INTERRUPT
from tidal.workers.rollout_instance import PromptGroup
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
    handle: CallHandle[Any]
    t0: float
    payload: Any = None


#: the actor's per-iter metrics that are counts (summed over the step's iters); the others (`grpo/pg_loss`,
#: `grpo/clip_frac`, ...) are token means of an iter, averaged over the step's iters
STEP_SUMS = frozenset({"grpo/tokens"})


@dataclass
class StepMeasurements:
    """What one step measured, appended to as results come back (the driver's result handlers write it; the
    control loop learns from it at the step's end and the step's metrics are read from it)."""

    actor_metrics: list[dict[str, float]] = field(default_factory=list)   # every rank's report of every iter
    # (mean batch, wall seconds per decode step) of every rollout call that generated: the decode cost, measured
    decode_samples: list[tuple[float, float]] = field(default_factory=list)
    # seconds per engine pump (admit + one decode step) inside the instance, per rollout call: the devices' own
    # speed, whatever the driver and the policy do (the machine's drift, for comparing runs)
    pump_samples: list[float] = field(default_factory=list)
    # (groups, tokens, wall seconds) of every scoring call: the scoring cost, measured
    score_samples: list[tuple[int, float, float]] = field(default_factory=list)
    # (tp, dp, tokens, wall seconds) of every actor iter: its cost per layout, measured
    iter_samples: list[tuple[int, int, float, float]] = field(default_factory=list)
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

    def add_work(self, key: str, value: float) -> None:
        self.work[key] = self.work.get(key, 0.0) + float(value)

    def metrics(self, iters_done: int) -> dict[str, float]:
        """The step's metrics from what it measured: the actor's per-iter reports folded over ranks and iters,
        where rollout instances holding work spent their time (seconds summed over the instances), the work."""
        out: dict[str, float] = {}
        for m in self.actor_metrics:
            for k, v in m.items():
                if k.startswith("mem/"):     # peaks: the largest
                    out[k] = max(out.get(k, 0.0), v)
                elif k.startswith("actor/"):  # per-rank figures: the mean over ranks and iters
                    out[k] = out.get(k, 0.0) + v / len(self.actor_metrics)
                elif k in STEP_SUMS:         # counts: each rank's share of the iter's, the step's total
                    out[k] = out.get(k, 0.0) + v
                else:                        # each rank's share of the iter's mean: the mean over the iters
                    out[k] = out.get(k, 0.0) + v / max(iters_done, 1)
        if self.pump_samples:
            out["rollout/pump_s_median"] = statistics.median(self.pump_samples)
        out["rollout/busy_instance_s"] = self.rollout_busy_s
        out["rollout/call_overhead_instance_s"] = self.rollout_call_s - self.rollout_busy_s
        out["rollout/gap_instance_s"] = self.rollout_gap_s
        out["rollout/gc_instance_s"] = self.rollout_gc_s
        out["reward/timeouts"] = float(self.reward_timeouts)
        out.update(self.work)
        return out


@dataclass
class StepState:
    """The step's work as the driver tracks it (rebuilt each step): what is queued, given, generated, scored and
    trained. The driver writes it; a migration moves its bookkeeping along through `moved`. What the step
    measured is `measured`."""

    step: int
    queue: deque[PromptGroup]
    num_groups: int
    groups: dict[int, PromptGroup] = field(default_factory=dict)   # group id -> its prompts (regenerated if lost)
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
    iter_tokens: float = 0.0
    held: bool = False
    iter_ranks: list[dict[str, float]] = field(default_factory=list)   # the running iter's per-rank reports
    # shared placements (tidal.pipeline.sharing): the step's hand-over to training and its KV release are done
    handed_over: bool = False
    kv_freed: bool = False
    waiting_since: dict[int, float] = field(default_factory=dict)   # instance -> since when it holds work, no call
    last_result: dict[int, float] = field(default_factory=dict)     # instance -> when its last call came back
    measured: StepMeasurements = field(default_factory=StepMeasurements)

    def moved(self, src: int, dst: int, summary: MoveSummary) -> None:
        """A migration moved `summary`'s groups from instance `src` to `dst`: the groups given and the last
        reports follow them (`move_reported`)."""
        self.given[src] = max(0, self.given.get(src, 0) - summary.groups)
        self.given[dst] = self.given.get(dst, 0) + summary.groups
        move_reported(self.reports, src, dst, summary)


@dataclass(frozen=True)
class StepTrace:
    """What a step generated and when its phases ended (seconds from the step's start): what `tidal plan
    --from-run` predicts the step from and holds its prediction against."""

    step: int
    seconds: float
    rollout_end_s: float                  #: the last group came back generated
    scoring_end_s: float                  #: the last group came back scored
    response_lengths: list[list[int]]     #: per group, in id order: each sample's response tokens
    prompt_lengths: list[int]             #: per group, in id order


@dataclass
class StepResult:
    step: int
    seconds: float
    metrics: dict[str, float]
    phase_seconds: dict[str, float]
    events: list[dict[str, Any]]
    trace: StepTrace | None = None


def move_reported(reports: dict[int, RolloutReport], src: int, dst: int, moved: MoveSummary) -> None:
    """Carry a migration's work from `src`'s last report to `dst`'s: its open groups and their sequences in the
    engine (running or waiting, with the tokens they generated). Queued groups need nothing: the reports count
    them as given minus in progress. Without both reports, both go and the estimate falls back to the given
    groups until the next reports."""
    a, b = reports.get(src), reports.get(dst)
    if a is None or b is None:
        reports.pop(src, None)
        reports.pop(dst, None)
        return
    reports[src] = replace(a, running=max(0, a.started - moved.requests), waiting=0,
                           progress=max(0, a.progress - moved.tokens),
                           groups_in_progress=max(0, a.groups_in_progress - moved.open))
    reports[dst] = replace(b, running=b.running + moved.requests, progress=b.progress + moved.tokens,
                           groups_in_progress=b.groups_in_progress + moved.open)


class Cluster:
    """The calls in flight on the run's workers and the run's event record."""

    def __init__(self, group: WorkerGroup, ledger: DeviceLedger, timeline: Timeline, clock: Callable[[], float]):
        self.group, self.ledger, self.timeline, self.clock = group, ledger, timeline, clock
        self.endpoints = Endpoints.on(group)   # every role's typed calls
        self.inflight: dict[Any, Flight] = {}
        self.slice_seq: dict[int, int] = {}          # device -> number of its last rollout slice
        self.events: list[dict[str, Any]] = []

    # ---- calls -------------------------------------------------------------------------------------------
    def track(self, kind: CallKind, handle: CallHandle[Any], payload: Any = None) -> Flight:
        """A call in flight whose result the driver's loop handles (`wait_any`, `drain`)."""
        f = Flight(kind, handle.device_id, handle, self.clock(), payload)
        self.inflight[f.handle.ref] = f
        return f

    def submit_slice(self, device: int, groups: list[PromptGroup], budget_s: float) -> Flight:
        """A rollout time slice, numbered per device: an interrupt names the last number it ends, so every slice
        queued by then ends and none submitted later does."""
        self.slice_seq[device] = seq = self.slice_seq.get(device, -1) + 1
        return self.track(CallKind.ROLLOUT, self.endpoints.rollout.run_slice(device, groups, budget_s, seq))

    def busy(self, device: int) -> bool:
        return any(f.device == device for f in self.inflight.values())

    def calls(self, device: int, kind: CallKind) -> int:
        return sum(f.device == device and f.kind == kind for f in self.inflight.values())

    def wait_any(self, timeout: float) -> list[tuple[Flight, Any]]:
        if not self.inflight:
            return []
        ready = self.group.wait_ready([f.handle for f in self.inflight.values()], timeout)
        out = []
        for h in ready:
            f = self.inflight[h.ref]
            res = self.group.gather([f.handle])[0]   # raises WorkerDied with the call still here, for recovery
            del self.inflight[h.ref]
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

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"kind": kind, "time": self.clock(), **fields}
        self.events.append(ev)
        log.info("%s %s", kind, {k: v for k, v in fields.items() if k != "kind"})
        return ev


