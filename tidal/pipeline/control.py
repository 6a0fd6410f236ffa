"""The real run's side of the controller: its observation adapter and its step end.

    driver (step start / iter boundary / step end)
        └─► ControlLoop.consult(trigger, step)
              scheduler.loop.Controller.consult(trigger, observe, RayActuator, ...)
                  signals  = ControlLoop.observe(...)          from the step's reports (typed, timestamped)
                  actions  = policy(state, signals, now)       pure; the same code the simulator runs
                  outcomes = reconcile(actions, RayActuator)   one event each
        ◄── proceed? (False while the policy says Wait)

The simulator (`scheduler.simulator`) runs the same `Controller` over its own observations and actuator; what
differs is only the world behind them.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from scheduler.estimate import LengthModel
from scheduler.learning import StepHistory
from scheduler.loop import Controller, Policy
from scheduler.observe import RolloutProgress, observe
from scheduler.signals import ActorLayout, ActorSignal, DeviceSignal, InferenceSignal, Signals
from scheduler.state import SchedState
from tidal.core.config import TidalConfig
from tidal.core.devices import DeviceLedger
from tidal.pipeline.actuator import RayActuator
from tidal.pipeline.cluster import Cluster, StepState

#: the same boundary is not asked again sooner than this (the driver asks while the actor waits)
MIN_INTERVAL_S = 0.2


def prefix(done: Container[int], n: int) -> int:
    """Length of the prefix 0, 1, ... of group ids present in `done`."""
    k = 0
    while k < n and k in done:
        k += 1
    return k


def rollout_progress(st: StepState, instances: list[int], lent: frozenset[int], group_size: int) -> RolloutProgress:
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
    """The real run's observations and step end around the `Controller` (the policy, its state, the throttle,
    the breaker, the decision events, learning). `actuator` owns the placement; `cluster` records the events."""

    def __init__(self, cfg: TidalConfig, policy: Policy, sched_state: SchedState, cluster: Cluster,
                 ledger: DeviceLedger, actuator: RayActuator, min_interval_s: float = MIN_INTERVAL_S):
        self.cfg, self.c, self.ledger, self.actuator = cfg, cluster, ledger, actuator
        self.controller = Controller(policy, sched_state, cluster.record, contain=True,
                                     lengths=LengthModel.prior(cfg.rollout.max_new_tokens),
                                     min_interval_s=min_interval_s, notes_predictions=True)
        self._t_start = 0.0

    # ---- observe ----------------------------------------------------------------------------------------------
    def observe(self, trigger: str, st: StepState) -> Signals:
        c, cfg, p = self.c, self.cfg, self.actuator.placement
        insts = sorted(p.rollout)
        progress = rollout_progress(st, insts, p.lent, cfg.algorithm.group_size) if insts else None
        done = st.generated == st.num_groups and not st.to_score and st.scoring == 0
        inference = InferenceSignal(p.inference, len(st.to_score) + st.scoring,
                                    prefix(st.scored, st.num_groups), done, p.inference_lent)
        lay = p.actor
        actor = ActorSignal(st.iters_done, cfg.algorithm.n_minibatches, not st.iter_running,
                            ActorLayout(lay.tp, lay.dp, lay.devices), st.last_iter_s,
                            lent_out=p.actor_lent_out, held=st.held)
        return observe(c.clock(), st.step, trigger, progress, self.controller.lengths, inference, actor,
                       DeviceSignal.from_snapshot(self.ledger.snapshot()), st.num_groups,
                       prefix(st.gen_time, st.num_groups), not st.queue)

    # ---- decide and act ---------------------------------------------------------------------------------------
    def consult(self, trigger: str, st: StepState, data_ready: bool = False, data_generated: bool = False) -> bool:
        """Ask the policy; apply its actions. Returns False if the actor must wait (a `Wait` action).
        `data_ready`: the actor's next mini-batch is scored; `data_generated`: it is generated (scoring may still
        run). The first ask with either is never skipped: the policy decides then whether lent devices come
        back, and their moves run while the last groups are scored. "generated" matters to the throttle only
        while the actor's devices are lent (the policy may take them back then)."""
        if trigger == "start":
            self._t_start = self.c.clock()
            self.actuator.begin_step(st)
        lent_out = self.actuator.placement.actor_lent_out
        key = (st.iters_done, data_ready, data_generated and lent_out, lent_out)
        out = self.controller.consult(trigger, st.step, lambda: self.observe(trigger, st), self.actuator,
                                      self.c.clock, throttle_key=key)
        return not out.held

    # ---- end of step -------------------------------------------------------------------------------------------
    def return_lent(self, why: str) -> None:
        self.actuator.return_lent(why)

    def end_step(self, st: StepState) -> None:
        """Back to the homes, every call not waited for checked, then learn from the step."""
        self.actuator.restore()
        self.actuator.settle_notes()
        self.learn(st)

    def learn(self, st: StepState) -> None:
        scored = list(st.scored.values())
        history = StepHistory(
            st.step, self._t_start, [len(r) for sg in scored for r in sg.response_ids],
            [len(sg.prompt_ids) for sg in scored], np.asarray([st.gen_time[i] for i in sorted(st.gen_time)]),
            st.measured.decode_samples, st.measured.score_samples, st.measured.iter_samples,
            [e for e in self.c.events if e.get("step") == st.step], self.controller.predictions())
        self.controller.learn(history, self.cfg.rollout.max_new_tokens, self.cfg.inference.tensor_parallel_size)
