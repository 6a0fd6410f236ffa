"""Applying a decision: one loop for the real cluster and the simulator.

    signals  = observe(...)                        scheduler.observe: one producer of what the policy sees
    actions  = decide(state, signals, now)         scheduler.policies: pure
    outcomes = reconcile(actions, actuator, ...)   here: each action through the `Actuator`, one outcome each

An `Actuator` is the mechanism: one method per action type, each taking the typed action and returning a
dict of what it did (recorded with the outcome). `tidal.pipeline.actuator.RayActuator` moves real workers;
the simulator's `_Sim` moves simulated instances and charges the cost model's seconds. Both keep device
ownership in a `tidal.core.devices.DeviceLedger`, so an action that double-books a device fails the same way in
both (IllegalTransition).

Failures: on real workers an action can fail (a worker's error, a refused release); the actuator leaves the
cluster as it was before that action (migration is two-phase, resharding rolls back inside the engine) and
`reconcile` records the failure with its reason and goes on with the next action (`contain=True`). After
`MAX_FAILURES_PER_STEP` failed actions in one step the `FailureBreaker` opens: the policy is not consulted
again until the step ends, and the step completes on its current placement. In the simulator an action that
fails is a bug of the policy or the simulator and raises (`contain=False`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.actions import (
    Action,
    LendInference,
    LendToRollout,
    MigrateBatch,
    MigrateRequests,
    ReleaseInference,
    ReleaseRollout,
    ReshardActor,
    ReturnFromRollout,
    ReturnToInference,
    StartRollout,
    Wait,
)

log = logging.getLogger("tidal.scheduler")

#: failed actions in one step after which the policy is not consulted again until the step ends: a policy that
#: keeps asking for a move the cluster cannot make must not spin the driver; the step completes on its placement
MAX_FAILURES_PER_STEP = 5


class Actuator(Protocol):
    """The mechanism behind the actions: each method applies one action completely or raises, leaving the
    cluster as it was before it (on real workers) and its devices' ownership in the ledger consistent. None
    for "nothing to record" (the simulator's methods): `apply_action` reads it as {}."""

    def wait(self, a: Wait) -> None: ...
    def migrate_requests(self, a: MigrateRequests) -> dict | None: ...
    def migrate_batch(self, a: MigrateBatch) -> dict | None: ...
    def release_rollout(self, a: ReleaseRollout) -> dict | None: ...
    def return_from_rollout(self, a: ReturnFromRollout) -> dict | None: ...
    def release_inference(self, a: ReleaseInference) -> dict | None: ...
    def reshard_actor(self, a: ReshardActor) -> dict | None: ...
    def lend_to_rollout(self, a: LendToRollout) -> dict | None: ...
    def start_rollout(self, a: StartRollout) -> dict | None: ...
    def lend_inference(self, a: LendInference) -> dict | None: ...
    def return_to_inference(self, a: ReturnToInference) -> dict | None: ...


#: action type -> the actuator method that applies it (every action type has exactly one)
_METHOD: dict[type[Action], str] = {
    Wait: "wait", MigrateRequests: "migrate_requests", MigrateBatch: "migrate_batch",
    ReleaseRollout: "release_rollout", ReturnFromRollout: "return_from_rollout",
    ReleaseInference: "release_inference", ReshardActor: "reshard_actor", LendToRollout: "lend_to_rollout",
    StartRollout: "start_rollout", LendInference: "lend_inference", ReturnToInference: "return_to_inference",
}


@dataclass(frozen=True)
class Outcome:
    """What applying one action did: `detail` is the actuator's own account (devices, groups, bytes moved)."""

    action: Action
    ok: bool
    error: str = ""
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class FailureBreaker:
    """Counts failed actions per step; open once a step has `limit` of them (see the module doc)."""

    limit: int = MAX_FAILURES_PER_STEP
    failures: dict[int, int] = field(default_factory=dict)

    def open(self, step: int) -> bool:
        return self.failures.get(step, 0) >= self.limit

    def failed(self, step: int) -> bool:
        """Count one failure; True when it is the one that opens the breaker."""
        n = self.failures[step] = self.failures.get(step, 0) + 1
        return n == self.limit


def apply_action(a: Action, actuator: Actuator) -> dict:
    method = _METHOD.get(type(a))
    if method is None:
        raise TypeError(f"no actuator method for {type(a).__name__}")
    return getattr(actuator, method)(a) or {}


def _error_text(err: BaseException) -> str:
    # a worker's error (tidal.workers WorkerCallError, not imported here) names its device and carries its own
    # last line: that, not the transport's traceback
    cause = getattr(err, "cause", "")
    text = (f"{type(err).__name__} on device {getattr(err, 'device_id', '?')}: {cause}" if cause
            else f"{type(err).__name__}: {err}")
    return text[:500]


def reconcile(actions: Sequence[Action], actuator: Actuator, clock: Callable[[], float], *, contain: bool,
              on_outcome: Callable[[Outcome], None] | None = None) -> tuple[list[Outcome], bool]:
    """Apply `actions` in order through `actuator`. Returns (outcomes of the non-Wait actions, held), `held`
    being True when the list holds a `Wait` (the actor stays at its boundary). With `contain`, a failed action
    becomes a failed outcome and the next action still runs; without it the error propagates."""
    outcomes: list[Outcome] = []
    held = False
    for a in actions:
        if isinstance(a, Wait):
            held = True
            actuator.wait(a)
            continue
        t0 = clock()
        ok, error, detail = True, "", {}
        try:
            detail = apply_action(a, actuator)
        except Exception as err:
            if not contain:
                raise
            ok, error = False, _error_text(err)
            log.warning("action %s failed: %s", type(a).__name__, error)
        out = Outcome(a, ok, error, clock() - t0, detail)
        outcomes.append(out)
        if on_outcome is not None:
            on_outcome(out)
    return outcomes, held
