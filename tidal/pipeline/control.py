"""The control loop of a real run: at the driver's triggers, observe -> decide -> reconcile; at the step end,
restore the placement and learn.

    driver (step start / iter boundary / step end)
        └─► ControlLoop.consult(trigger, step)
              signals  = scheduler.observe.observe(...)      from the step's reports (typed, timestamped)
              actions  = policy(state, signals, now)         pure; the same code the simulator runs
              outcomes = scheduler.reconcile.reconcile(actions, RayActuator, ...)   one event each
        ◄── proceed? (False while the policy says Wait)

The simulator (`scheduler.simulator`) runs the same `observe`, policies and `reconcile` over its own
actuator; what differs is only the world behind the actuator.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from scheduler.actions import describe
from scheduler.estimate import LengthModel
from scheduler.learning import RolloutPrediction, StepHistory, learn_step
from scheduler.observe import RolloutProgress, observe
from scheduler.reconcile import FailureBreaker, Outcome, reconcile
from scheduler.signals import ActorLayout, ActorSignal, DeviceSignal, InferenceSignal, Signals
from scheduler.state import SchedState
from tidal.core.devices import DeviceLedger
from tidal.engine.layout import Layout
from tidal.pipeline.actuator import RayActuator
from tidal.pipeline.cluster import Cluster, StepState

#: the same boundary is not asked again sooner than this (the driver asks while the actor waits)
MIN_INTERVAL_S = 0.2
#: at most one note of the rollout's remaining work per this many seconds (`learn_step` prices them)
PREDICTION_INTERVAL_S = 0.25


def prefix(done, n: int) -> int:
    """Length of the prefix 0, 1, ... of group ids present in `done`."""
    k = 0
    while k < n and k in done:
        k += 1
    return k


def rollout_progress(st: StepState, instances: list[int], lent: set[int], group_size: int) -> RolloutProgress:
    """The instances' last reports as `RolloutProgress`: sequences started in the engine with their progress,
    and sequences not started (groups given but not opened yet). Groups the driver has not handed out yet are
    work all the same: each instance will pull an even share of them (RLinf's regime: many more sequences than
    slots), so the policy does not see the step as nearly done while most of it waits in the driver's queue."""
    n, g = len(instances), group_size
    started, progress, queued = np.zeros(n), np.zeros(n), np.zeros(n)
    tokens, rate = np.zeros(n), np.zeros(n)
    given = np.asarray([st.given.get(i, 0) for i in instances], dtype=np.int64)
    for k, inst in enumerate(instances):
        r = st.reports.get(inst)
        if r is not None:
            tokens[k], rate[k] = r.tokens, r.token_rate
        if r is not None and given[k]:
            started[k] = r.started
            progress[k] = r.progress
            queued[k] = max(0, given[k] - r.groups_in_progress) * g
        else:
            queued[k] = given[k] * g
    if n and st.queue:
        queued += len(st.queue) * g / n
    return RolloutProgress(
        np.asarray(instances, dtype=np.int64), [(i,) for i in instances], np.ones(n, dtype=np.int64), started,
        progress, queued, queued.astype(np.int64) // g, given, (started + queued).astype(np.int64),
        np.asarray([st.total_given.get(i, 0) for i in instances], dtype=np.int64), tokens, rate,
        np.asarray([i in lent for i in instances], dtype=bool))


class ControlLoop:
    """Owns the scheduler's side of a run: the policy and its state, the length model, the failure breaker and
    the notes `learn_step` needs. `actuator` owns the placement; `cluster` records the events."""

    def __init__(self, cfg, policy: Callable, sched_state: SchedState, cluster: Cluster, ledger: DeviceLedger,
                 actuator: RayActuator, initial_layout: Layout, min_interval_s: float = MIN_INTERVAL_S):
        self.cfg, self.policy, self.sched_state = cfg, policy, sched_state
        self.c, self.ledger, self.actuator = cluster, ledger, actuator
        #: the placement each step starts on and the step end restores (`tidal.pipeline.survivors` changes it when
        #: a device is lost for good)
        self.initial_layout = initial_layout
        self.rollout_home, self.inference_home = tuple(cfg.placement.rollout), tuple(cfg.placement.inference)
        self.min_interval_s = min_interval_s
        self.lengths = LengthModel.prior(cfg.rollout.max_new_tokens)
        self.breaker = FailureBreaker()
        self._last: tuple[tuple, float] | None = None
        self._held_since: float | None = None
        self._predictions: list[RolloutPrediction] = []
        self._t_start = 0.0

    # ---- observe ----------------------------------------------------------------------------------------------
    def observe(self, trigger: str, st: StepState) -> Signals:
        c, cfg = self.c, self.cfg
        insts = sorted(c.rollout)
        progress = rollout_progress(st, insts, c.lent, cfg.algorithm.group_size) if insts else None
        done = st.generated == st.num_groups and not st.to_score and st.scoring == 0
        inference = InferenceSignal(tuple(c.inference), len(st.to_score) + st.scoring,
                                    prefix(st.scored, st.num_groups), done, tuple(self.actuator.inf_lent))
        lay = c.actor_layout
        actor = ActorSignal(st.iters_done, cfg.algorithm.n_minibatches, not st.iter_running,
                            ActorLayout(lay.tp, lay.dp, lay.devices), st.last_iter_s,
                            lent_out=bool(c.lent & set(lay.devices)), held=st.held)
        return observe(c.clock(), st.step, trigger, progress, self.lengths, inference, actor,
                       DeviceSignal.from_snapshot(self.ledger.snapshot()), st.num_groups,
                       prefix(st.gen_time, st.num_groups), not st.queue)

    # ---- decide and act ---------------------------------------------------------------------------------------
    def _asked_just_now(self, trigger: str, st: StepState, data_ready: bool, data_generated: bool) -> bool:
        """The same boundary asked again within `min_interval_s`: nothing new to see. "generated" matters only
        while the actor's devices are lent (the policy may take them back then)."""
        now = self.c.clock()
        lent_out = bool(self.c.lent & set(self.c.actor_layout.devices))
        key = (trigger, st.step, st.iters_done, data_ready, data_generated and lent_out, lent_out)
        if trigger == "boundary" and self._last and self._last[0] == key and \
                now - self._last[1] < self.min_interval_s:
            return True
        self._last = (key, now)
        return False

    def consult(self, trigger: str, st: StepState, data_ready: bool = False, data_generated: bool = False) -> bool:
        """Ask the policy; apply its actions. Returns False if the actor must wait (a `Wait` action).
        `data_ready`: the actor's next mini-batch is scored; `data_generated`: it is generated (scoring may still
        run). The first ask with either is never skipped: the policy decides then whether lent devices come
        back, and their moves run while the last groups are scored."""
        if self._asked_just_now(trigger, st, data_ready, data_generated):
            return self._held_since is None
        now = self.c.clock()
        if trigger == "start":
            self._t_start = now
            self.actuator.begin_step(st)
        if self.breaker.open(st.step):
            return True   # the step finishes on its current placement (the driver returns lent devices)
        sig = self.observe(trigger, st)
        self._note_prediction(sig, now)
        t0 = time.perf_counter()
        actions = self.policy(self.sched_state, sig, now)
        if actions:
            self._record_decision(sig, trigger, actions, time.perf_counter() - t0)
        _, held = reconcile(actions, self.actuator, self.c.clock, contain=True,
                            on_outcome=lambda o: self._record_outcome(o, sig))
        self._held_since = (self._held_since or now) if held else None
        return not held

    def _record_decision(self, sig: Signals, trigger: str, actions: list, decide_s: float) -> None:
        cols = sig.cols   # what the policy saw, so a decision can be checked against what happened next
        self.c.record("decision", step=sig.step, iter=sig.actor.iters_done, trigger=trigger,
                      actions=describe(actions), decide_s=decide_s,
                      seen={"running": int(cols.running.sum()), "groups_generated": sig.groups_generated,
                            "groups_scored": sig.inference.groups_finished,
                            "est_remaining_tokens": float(cols.est_remaining_tokens.sum()),
                            "est_tail_tokens": sig.tail_tokens, "instances": int(cols.id.size)})

    def _record_outcome(self, o: Outcome, sig: Signals) -> None:
        if not o.ok and self.breaker.failed(sig.step):
            n = self.breaker.limit
            self.c.record("scheduler_paused", step=sig.step, failures=n,
                          reason=f"{n} failed actions this step: the policy is not consulted until the step ends")
        self.c.record("action", step=sig.step, iter=sig.actor.iters_done, action=type(o.action).__name__,
                      reason=o.action.reason, ok=o.ok, error=o.error, seconds=o.seconds, **o.detail)

    def _note_prediction(self, sig: Signals, now: float) -> None:
        """Note what is left of this step's rollout now: `learn_step` prices it with the cost model and compares
        with when rollout really ended."""
        if not sig.running or (self._predictions and now - self._predictions[-1].time < PREDICTION_INTERVAL_S):
            return
        cols = sig.cols
        self._predictions.append(RolloutPrediction(now, float(cols.est_remaining_tokens.sum()), sig.tail_tokens,
                                                   int(cols.id.size)))

    # ---- end of step -------------------------------------------------------------------------------------------
    def return_lent(self, why: str) -> None:
        self.actuator.return_lent(why)

    def end_step(self, st: StepState) -> None:
        """Back to the initial placement, every call not waited for checked, then learn from the step."""
        self.actuator.restore(self.initial_layout, self.rollout_home, self.inference_home)
        self.actuator.settle_notes()
        self.learn(st)

    def learn(self, st: StepState) -> None:
        scored = list(st.scored.values())
        history = StepHistory(
            st.step, self._t_start, [len(r) for sg in scored for r in sg.response_ids],
            [len(sg.prompt_ids) for sg in scored], np.asarray([st.gen_time[i] for i in sorted(st.gen_time)]),
            st.decode_samples, st.score_samples, st.iter_samples,
            [e for e in self.c.events if e.get("step") == st.step], self._predictions)
        self._predictions = []
        learned = learn_step(self.sched_state, history, self.cfg.rollout.max_new_tokens,
                             self.cfg.inference.tensor_parallel_size)
        if learned is None:
            return
        self.sched_state, self.lengths = learned.state, learned.lengths
        self.c.record("learn", step=st.step, **learned.summary)
