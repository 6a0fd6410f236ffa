"""The controller: observe -> decide -> reconcile, one loop for the real run and the simulator.

    world (driver or simulator)                  Controller.consult(trigger, ...)
    ───────────────────────────                  ───────────────────────────────
    its observation adapter: () -> Signals  ──►  throttle: the same boundary asked again within min_interval_s
    its actuator (scheduler.reconcile)           breaker: open after MAX_FAILURES_PER_STEP failed actions
                                                 signals = observe()
                                                 actions = policy(state, signals, now)        pure
                                                 record("decision", ...)
                                                 reconcile(actions, actuator)  ─► record("action", ...) each
                                           ◄──   Consultation(actions, outcomes, held)

What differs between the two worlds is only what they hand in: the real run contains a failed action (its
actuator leaves the cluster as it was; `contain=True`) and throttles repeated asks in wall time (the driver asks
while the actor waits); the simulator raises on a failed action (a bug of the policy or the simulator) and asks
at its own events, whose cadence `SimSpec.poll_s` sets (`min_interval_s=0`). The decision events are built here,
so both worlds record the same event for the same signals.

Learning (`learn`): a real run learns its costs and the workload's shape from the step's history
(`scheduler.learning.learn_step`), with the rollout predictions noted at each consultation; the simulator's cost
model is its ground truth, so it refits only the workload's shape (`scheduler.simulator`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.actions import Action, describe
from scheduler.estimate import LengthModel
from scheduler.learning import RolloutPrediction, StepHistory, learn_step
from scheduler.reconcile import Actuator, FailureBreaker, Outcome, reconcile
from scheduler.signals import Signals
from scheduler.state import SchedState

#: at most one note of the rollout's remaining work per this many seconds (`learn_step` prices them)
PREDICTION_INTERVAL_S = 0.25

Policy = Callable[[SchedState, Signals, float], list[Action]]


class Recorder(Protocol):
    """Where the controller's events go: `record(kind, **fields)` (the real run's event list, the simulator's)."""

    def __call__(self, kind: str, **fields: Any) -> object: ...


@dataclass(frozen=True)
class Consultation:
    """One consultation: what the policy saw and asked for, and what applying it did. `skipped`: throttled or
    the breaker open (the policy was not asked)."""

    trigger: str
    step: int
    signals: Signals | None
    actions: tuple[Action, ...] = ()
    outcomes: tuple[Outcome, ...] = ()
    held: bool = False
    skipped: bool = False


def decision_event(sig: Signals, trigger: str, actions: Sequence[Action], decide_s: float) -> dict[str, Any]:
    """The `decision` event's fields: the actions and what the policy saw, so a decision can be checked against
    what happened next."""
    cols = sig.cols
    return {"step": sig.step, "iter": sig.actor.iters_done, "trigger": trigger, "actions": describe(list(actions)),
            "decide_s": decide_s,
            "seen": {"running": int(cols.running.sum()), "groups_generated": sig.groups_generated,
                     "groups_scored": sig.inference.groups_finished,
                     "est_remaining_tokens": float(cols.est_remaining_tokens.sum()),
                     "est_tail_tokens": sig.tail_tokens, "instances": int(cols.id.size)}}


@dataclass
class Controller:
    """Owns the scheduler's side of a run: the policy and its state, the length model the signals use, the
    throttle, the failure breaker, the events of decisions and outcomes, and learning (module doc)."""

    policy: Policy
    state: SchedState
    record: Recorder | None
    contain: bool
    lengths: LengthModel
    min_interval_s: float = 0.0
    breaker: FailureBreaker = field(default_factory=FailureBreaker)
    #: notes of the rollout's remaining work for `learn` (a real run's; the simulator does not learn costs)
    notes_predictions: bool = False
    #: every consultation the policy answered, in order (tests, replays); None: not kept
    trace: list[Consultation] | None = None
    _last: tuple[tuple[Any, ...], float] | None = None
    _held_since: float | None = None
    _predictions: list[RolloutPrediction] = field(default_factory=list)

    def consult(self, trigger: str, step: int, observe: Callable[[], Signals], actuator: Actuator,
                clock: Callable[[], float], throttle_key: tuple[Any, ...] | None = None) -> Consultation:
        """Ask the policy at `trigger` and apply its actions through `actuator`. `throttle_key`: what the world
        would show the policy at this boundary; an ask with the key of the last one within `min_interval_s` is
        skipped (nothing new to see) and keeps the last answer's hold."""
        now = clock()
        if throttle_key is not None and self._asked_just_now(trigger, step, throttle_key, now):
            return Consultation(trigger, step, None, held=self._held_since is not None, skipped=True)
        if self.breaker.open(step):
            return Consultation(trigger, step, None, skipped=True)   # the step finishes on its placement
        sig = observe()
        if self.notes_predictions:
            self._note_prediction(sig, now)
        t0 = time.perf_counter()
        actions = self.policy(self.state, sig, now)
        if actions and self.record is not None:
            self.record("decision", **decision_event(sig, trigger, actions, time.perf_counter() - t0))
        outcomes, held = reconcile(actions, actuator, clock, contain=self.contain,
                                   on_outcome=lambda o: self._outcome(o, sig))
        self._held_since = (self._held_since or now) if held else None
        out = Consultation(trigger, step, sig, tuple(actions), tuple(outcomes), held)
        if self.trace is not None:
            self.trace.append(out)
        return out

    def _asked_just_now(self, trigger: str, step: int, key: tuple[Any, ...], now: float) -> bool:
        full = (trigger, step, *key)
        if trigger == "boundary" and self._last and self._last[0] == full and \
                now - self._last[1] < self.min_interval_s:
            return True
        self._last = (full, now)
        return False

    def _outcome(self, o: Outcome, sig: Signals) -> None:
        if not o.ok and self.breaker.failed(sig.step) and self.record is not None:
            n = self.breaker.limit
            self.record("scheduler_paused", step=sig.step, failures=n,
                        reason=f"{n} failed actions this step: the policy is not consulted until the step ends")
        if self.record is not None:
            self.record("action", step=sig.step, iter=sig.actor.iters_done, action=type(o.action).__name__,
                        reason=o.action.reason, ok=o.ok, error=o.error, seconds=o.seconds, **o.detail)

    def _note_prediction(self, sig: Signals, now: float) -> None:
        """What is left of this step's rollout now: `learn_step` prices it with the cost model and compares it
        with when rollout really ended."""
        if not sig.running or (self._predictions and now - self._predictions[-1].time < PREDICTION_INTERVAL_S):
            return
        cols = sig.cols
        self._predictions.append(RolloutPrediction(now, float(cols.est_remaining_tokens.sum()), sig.tail_tokens,
                                                   int(cols.id.size)))

    def predictions(self) -> list[RolloutPrediction]:
        """The step's rollout predictions, handed over once (the next step starts a new list)."""
        out, self._predictions = self._predictions, []
        return out

    def refit(self, state: SchedState, lengths: LengthModel) -> None:
        """The simulator's learning: the workload's shape, refit by the world whose cost model is the truth."""
        self.state, self.lengths = state, lengths

    def learn(self, history: StepHistory, max_new_tokens: int, inference_tp: int) -> dict[str, Any] | None:
        """Learn from a finished real step: the policy's state and the length model for the next one. Returns
        what was learned (recorded as a `learn` event), or None when the step taught nothing."""
        learned = learn_step(self.state, history, max_new_tokens, inference_tp)
        if learned is None:
            return None
        self.state, self.lengths = learned.state, learned.lengths
        if self.record is not None:
            self.record("learn", step=history.step, **learned.summary)
        return dict(learned.summary)
