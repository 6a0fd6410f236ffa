"""Discrete-event simulator of RL steps, driving the same policy code as the real scheduler service.

One RL step::

    start:  placement restored; decide("start") (pre-process / tidal may lend the actor's and inference's
            devices); the step's groups are dealt in fixed contiguous slices over the rollout instances
            (RLinf's dispatch, all policies)
    rollout instance --group generated--> inference (FIFO over its instances; while every one is lent the
            groups wait) --group scored--> actor
    actor:  iter j starts when (j+1) x groups_per_iter groups are scored, it is at a boundary, not held by a
            Wait, not lent and not resharding; iter j done -> decide("boundary")
    end:    after the last iter, decide("boundary") (the actor returns to its initial layout), weight sync

Events are per group (generated, scored) and per actor iter, never per token (`rollout_model.py` computes
continuous batching in closed form). Speed: the instances a decision touches are re-laid in one vectorised
batch (`lay_out`), the signals of all instances come from one packed snapshot (`Packed.at`, cached until an
epoch changes), and `Signals.rollout` is a lazy `RolloutView` over producer-built columns, so a decision costs
O(numpy over instances) and no Python loop per instance: 1,024 devices x 100 steps take seconds of CPU.

Who calls the policy: iter done ("boundary"); an instance drained ("drain", coalesced: at most one call per
1/8 of the instances draining); inference done ("inference"); a requested recheck ("tick", one per instant);
with `SimSpec.poll_s`, every `poll_s` while the actor waits at a boundary ("boundary", as the real driver asks).
The actor's first mini-batch scored while its devices are lent ("data_ready"). While a Wait holds the actor
the signal says so (`ActorSignal.held`) and the next of these events asks again. Actions are applied through
a `tidal.core.devices.DeviceLedger`, so a policy that double-books a device fails loudly (IllegalTransition).
Migration cost lands on the receiving instance's epoch start: re-prefill (`CostModel.migration_time`; several
arrivals in one decision add up), or a KV-cache copy when the action says `kv`: the real actuator runs a
decision's KV moves as waves of one call per device and phase, so every instance a wave touches, source or
target, pauses once for `kv_fixed_s` and a target adds the bytes of each arrival.

What the producer learns for the policy (`SchedState`), as a real service would from its own history: the
length model (mean residual and tail of response lengths) from the previous step's responses, each actor
iter's share of the step's tokens, and the readiness curve (fraction of rollout time by which k/16 of the
groups were generated).

Metrics: per-step wall time; device idle fraction = 1 - useful device-seconds / (devices x time), useful
being decode (instance with unfinished sequences), scoring and training; reshard, migration, lend and sync
time count as not useful. The event list holds step, iter, decision and action events (not group events).
"""

from __future__ import annotations

import heapq
import math
import time as _time
from typing import Any

import numpy as np

from scheduler.actions import (
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
from scheduler.estimate import LengthModel
from scheduler.learning import ready_curve
from scheduler.loop import Controller
from scheduler.observe import RolloutProgress, observe
from scheduler.policies import get_policy
from scheduler.rollout_model import Instance, Packed, Work, lay_out, settle_many
from scheduler.signals import ActorLayout, ActorSignal, DeviceSignal, InferenceSignal, Signals
from scheduler.sim_records import SimEvent, SimResult, StepStats
from scheduler.state import SchedState
from scheduler.workload import SimSpec
from tidal.core.config import TidalConfig
from tidal.core.devices import DeviceLedger, Owner
from tidal.core.errors import TidalError

__all__ = ["SimEvent", "SimResult", "StepStats", "simulate"]


#: a "drain" decision is asked once 1/DRAIN_BATCH of the instances drained since the last one (or the last group
#: was generated): every drain at small sizes, batches of 64 at 1,024 devices (decisions cost O(instances))
DRAIN_BATCH = 8


def _started(w: Work, started: bool) -> Work:
    """The sequences of `w` that have generated tokens (`started`) or not, in their order."""
    keep = (w.prog > 0) == started
    return Work(w.gid[keep], w.rem[keep], w.prog[keep])


class _Actor:
    def __init__(self, layout: ActorLayout):
        self.layout = layout
        self.iters_done = 0
        self.running = False
        self.ready_at = 0.0      # busy resharding / reloading until then
        self.ready_pushed = -1.0
        self.held = False
        self.lent = False
        self.last_iter_s = 0.0


class _Sim:
    # set per step by `_reset_step` (and reset to None by `_new_instances` / `_relay` when they go stale)
    inst_order: list[Instance] | None
    packed: Packed | None

    def __init__(self, spec: SimSpec, policy: str, seed: int, keep_events: bool):
        self.spec, self.p, self.c = spec, spec.params, spec.costs
        self.policy_name = policy
        self.decide = get_policy(policy)
        self.seed = seed
        self.keep_events = keep_events
        self.events: list[SimEvent] = []
        self.now = 0.0
        self.ledger = DeviceLedger(range(self.p.num_devices), clock=lambda: self.now)
        self.length_model = LengthModel.prior(spec.max_new_tokens)
        #: the policy's side (`scheduler.loop`): a failed action is a bug here and raises; asks are not
        #: throttled (the simulator asks at its own events; `SimSpec.poll_s` sets how often while the actor waits)
        self.controller = Controller(self.decide, SchedState(self.p, self.c, self.length_model.mean,
                                                             float(spec.prompt_tokens)),
                                     self._record if keep_events else None, contain=False,
                                     lengths=self.length_model)
        self.busy = {"rollout": 0.0, "inference": 0.0, "actor": 0.0}
        self.ledger.assign(self.p.actor_devices, Owner.ACTOR, "placement")
        self.ledger.assign(self.p.rollout_devices, Owner.ROLLOUT, "placement")
        self.ledger.assign(self.p.inference_devices, Owner.INFERENCE, "placement")
        self.iter_shares: tuple[float, ...] = ()       # learned from the previous step (SchedState)
        self.ready_curve: tuple[float, ...] = ()
        self.owners = [Owner.FREE] * self.p.num_devices   # mirror of the ledger for cheap DeviceSignals
        self._sync_owners()

    # --- helpers ---------------------------------------------------------------------------------------
    def log(self, kind: str, detail: str) -> None:
        if self.keep_events:
            self.events.append(SimEvent(round(self.now, 6), self.step, kind, detail))

    def push(self, t: float, kind: str, *payload) -> None:
        if kind == "tick":   # one poll per instant, however many decisions asked for it
            if t in self.ticks:
                return
            self.ticks.add(t)
        self._seq += 1
        heapq.heappush(self.heap, (t, self._seq, kind, payload))

    def _sync_owners(self) -> None:
        snap = self.ledger.snapshot()
        self.owners = [snap[d] for d in range(self.p.num_devices)]
        self._dev_sig = DeviceSignal(tuple(self.owners))

    def _new_instances(self, devices: tuple[int, ...], lent: bool, ready_at: float) -> list[Instance]:
        tp = self.p.rollout_tp
        out = []
        for k in range(0, len(devices), tp):
            devs = devices[k:k + tp]
            inst = Instance(devs[0], devs, self.p.max_running_requests, lent)
            inst.ready_at = ready_at
            self.inst[devs[0]] = inst
            self.inst_order = self.packed = None
            out.append(inst)
        return out

    def _schedule(self, inst: Instance) -> None:
        t = inst.next_event()
        if t is not None:
            self.drained_ids.discard(inst.id)
            self.push(t, "group", inst.id, inst.version)

    def _relay(self, pending: dict[int, tuple[float, list[Work]]]) -> None:
        """Lay out every instance a decision touched, in one batch, from its pending (t0, work)."""
        if not pending:
            return
        ids = list(pending)
        works = [Work.cat(pending[i][1]) for i in ids]
        epochs = lay_out(works, [pending[i][0] for i in ids], self.p.max_running_requests, self.c.decode)
        self.packed = None
        for iid, e in zip(ids, epochs):
            inst = self.inst[iid]
            inst.set_epoch(e)
            self._schedule(inst)
        for iid in ids:
            inst = self.inst[iid]
            if inst.next_event() is None:
                self.on_drain(inst)

    # --- one step ---------------------------------------------------------------------------------------
    def run_step(self, step: int) -> StepStats:
        t_start = self.now
        self._reset_step(step)
        rng = np.random.default_rng([self.seed, step])
        p = self.p
        lengths = self.spec.lengths.sample(rng, p.rollout_batch_size, p.group_size, self.spec.max_new_tokens, step=step)
        self.group_tokens = (lengths.sum(axis=1) + p.group_size * self.spec.prompt_tokens).tolist()
        self.call("start")
        self._deal(lengths)
        self._run_events(step)
        return self._end_step(step, t_start, lengths)

    def _reset_step(self, step: int) -> None:
        """Every component back to the placement, nothing generated, scored or trained."""
        p, c = self.p, self.c
        self.step = step
        self.heap: list = []
        self.ticks: set[float] = set()
        self._seq = 0
        self.busy_at_start = dict(self.busy)
        self.inst: dict[int, Instance] = {}
        self.inst_order = None
        self.packed = None
        self.packed_q: tuple[float, dict] | None = None   # (time, Packed.at result) of the last signals
        self.drained_ids: set[int] = set()
        self.dispatched = False
        self._new_instances(p.rollout_devices, lent=False, ready_at=self.now)
        self.inf_devices = p.inference_devices
        self.inf_free = [(self.now, d) for d in range(0, len(p.inference_devices), p.inference_tp)]
        self.inf_lent: tuple[int, ...] = ()       # inference devices lent to rollout
        self.inf_wait: list[int] = []             # heap of generated group ids waiting for a scoring server
        self.actor = _Actor(p.initial_layout)
        self.n_generated = 0
        self.gen_seen = np.zeros(p.rollout_batch_size, dtype=bool)
        self.gen_prefix = 0                       # groups 0..k-1 all generated (what the actor can use)
        self.n_scored = 0
        self.scored_mask = np.zeros(p.rollout_batch_size, dtype=bool)
        self.scored_prefix = 0                    # groups 0..k-1 all scored: iter j trains ids [j*G/n, (j+1)*G/n)
        self.trained = 0
        self.counts = {"migrations": 0, "groups_migrated": 0, "reshards": 0, "decisions": 0}
        self.drain_pending = 0
        self.n_inst0 = len(self.inst)
        self.in_call = False
        self.kv_paused: set[int] = set()
        self.controller.refit(SchedState(p, c, self.length_model.mean, float(self.spec.prompt_tokens),
                                         self.iter_shares, self.ready_curve), self.length_model)
        self.gen_at = np.zeros(p.rollout_batch_size)
        self.iter_tokens: list[float] = []
        self.polling = False
        self.log("step_start", f"step {step}")

    def _deal(self, lengths: np.ndarray) -> None:
        """The step's groups dealt round robin, lowest ids first, as the driver deals them (tidal/pipeline/driver.py
        `_feed_rollout`): every instance's first wave holds the lowest ids, the actor's first mini-batches."""
        p, c = self.p, self.c
        ids = sorted(self.inst)
        lengths_f = lengths.astype(np.float64)
        works, t0s = [], []
        for k, iid in enumerate(ids):
            mine = np.arange(k, p.rollout_batch_size, len(ids), dtype=np.int64)
            inst = self.inst[iid]
            inst.assign(mine.tolist(), mine.size * p.group_size)
            gid = np.repeat(mine, p.group_size)
            works.append(Work(gid, lengths_f[mine].reshape(-1), np.zeros(gid.size)))
            prefill = c.decode.prefill_per_token_s * self.spec.prompt_tokens * min(gid.size, p.max_running_requests)
            t0s.append(max(self.now, inst.ready_at) + prefill)
        self.packed = None
        for iid, e in zip(ids, lay_out(works, t0s, p.max_running_requests, c.decode)):
            inst = self.inst[iid]
            inst.set_epoch(e)
            self._schedule(inst)
            if inst.next_event() is None:
                self.drained_ids.add(iid)
        self.dispatched = True
        self.n_inst0 = len(self.inst)   # drain decisions: one per 1/DRAIN_BATCH of the step's instances
        if any(i.lent for i in self.inst.values()):
            self.push(self.now + p.pre_process_check_s, "tick")

    def _run_events(self, step: int) -> None:
        """Events in time order until the actor's last iter is done."""
        heap, poll_s, nmb = self.heap, self.spec.poll_s, self.p.n_minibatches
        while True:
            if not heap:
                raise AssertionError(f"step {step} stalled at t={self.now:.3f}: actor iters {self.actor.iters_done}, "
                                     f"held={self.actor.held} lent={self.actor.lent}, scored {self.n_scored}")
            t, _, kind, payload = heapq.heappop(heap)
            if t > self.now:
                self.now = t
            match kind:
                case "iter_done":
                    if self.on_iter_done():
                        return
                case "scored":
                    self.on_scored(payload[0])
                case "group":
                    self.on_group(*payload)
                case "score_free":
                    self._dispatch_scoring()
                case "tick":
                    self.on_tick(t)
                case "ready":
                    self.try_start()
                case "poll":
                    if payload[0] != step:   # left over from the previous step
                        continue
                    self.on_poll()
            if poll_s and not self.polling and not self.actor.running and self.actor.iters_done < nmb:
                self.polling = True   # as the driver: ask again while the actor waits at its boundary
                self.push(self.now + poll_s, "poll", step)

    def _end_step(self, step: int, t_start: float, lengths: np.ndarray) -> StepStats:
        """Step end: reshard back (decided at the last boundary), weight sync; learn the workload's shape."""
        p = self.p
        end = max(self.now, self.actor.ready_at) + self.c.sync_time()
        self.now = end
        self._restore()
        self.log("step_end", f"step {step} took {end - t_start:.3f}s")
        self.length_model = LengthModel.fit(lengths.reshape(-1), self.spec.max_new_tokens)
        it = np.asarray(self.iter_tokens)
        self.iter_shares = tuple((it / it.sum()).tolist())
        # when the id-order prefix reached k groups (what the actor waits for), as the real producer learns it
        self.ready_curve = ready_curve(self.gen_at, t_start)
        dt = end - t_start
        self.last_rollout_end_s = float(self.gen_at.max() - t_start)   # `tidal plan --from-run` compares it
        useful = sum(self.busy[k] - self.busy_at_start[k] for k in self.busy)
        return StepStats(step, dt, 1.0 - useful / (p.num_devices * dt), self.n_generated, self.n_scored,
                         self.trained, self.counts["migrations"], self.counts["groups_migrated"],
                         self.counts["reshards"], self.counts["decisions"])

    def _restore(self) -> None:
        """End of step: every device back to its initial role (the next step starts from the placement)."""
        for inst in self.inst.values():
            inst.close_epoch(self.now)
            self.busy["rollout"] += inst.busy_s * len(inst.devices)
        want = dict.fromkeys(self.p.actor_devices, Owner.ACTOR)
        want.update(dict.fromkeys(self.p.rollout_devices, Owner.ROLLOUT))
        want.update(dict.fromkeys(self.p.inference_devices, Owner.INFERENCE))
        snap = self.ledger.snapshot()
        moved = [d for d, o in snap.items() if o is not want[d]]
        busy = [d for d in moved if snap[d] is not Owner.FREE]
        self.ledger.release(busy, "step end")
        self.ledger.free(busy, "step end")
        for role in (Owner.ACTOR, Owner.ROLLOUT, Owner.INFERENCE):
            self.ledger.assign([d for d in moved if want[d] is role], role, "step start: placement")
        if moved:
            self._sync_owners()

    # --- events -----------------------------------------------------------------------------------------
    def on_scored(self, g: int) -> None:
        p = self.p
        self._dispatch_scoring()   # its server is free: the lowest id waiting goes next
        self.n_scored += 1
        self.scored_mask[g] = True
        before = self.scored_prefix
        while self.scored_prefix < p.rollout_batch_size and self.scored_mask[self.scored_prefix]:
            self.scored_prefix += 1
        n, a = self.scored_prefix, self.actor
        need = (a.iters_done + 1) * p.groups_per_iter
        if self.n_scored == p.rollout_batch_size:
            self.call("inference")
        elif a.lent and before < need <= n:
            self.call("data_ready")
        if n >= need:
            self.try_start()

    def on_iter_done(self) -> bool:
        """The actor finished an iter; True when it was the step's last."""
        a = self.actor
        a.running = False
        a.iters_done += 1
        self.trained += self.p.groups_per_iter
        self.log("iter_done", f"iter {a.iters_done - 1} on {a.layout.size} devices")
        self.call("boundary")
        if a.iters_done == self.p.n_minibatches:
            return True
        self.try_start()
        return False

    def on_tick(self, t: float) -> None:
        self.ticks.discard(t)
        self.call("tick")
        self.try_start()

    def on_poll(self) -> None:
        self.polling = False
        if not self.actor.running and self.actor.iters_done < self.p.n_minibatches:
            self.call("boundary")
            self.try_start()

    def on_group(self, iid: int, version: int) -> None:
        inst = self.inst.get(iid)
        if inst is None or inst.version != version:
            return
        self.generated_groups(inst.pop_due(self.now))
        t = inst.next_event()
        if t is not None:
            self.push(t, "group", iid, inst.version)
        else:
            self.on_drain(inst)

    def on_drain(self, inst: Instance) -> None:
        if inst.id in self.drained_ids:
            return
        self.drained_ids.add(inst.id)
        self.drain_pending += 1
        if self.in_call:
            return  # drained by an action of the decision being applied: the policy already knows
        enough = self.drain_pending >= max(1, math.ceil(self.n_inst0 / DRAIN_BATCH))
        if enough or self.n_generated == self.p.rollout_batch_size:
            self.drain_pending = 0
            self.call("drain")
            self.try_start()

    def generated_groups(self, groups: list[int]) -> None:
        if not groups:
            return
        seen = self.gen_seen
        for g in groups:
            assert not seen[g], f"group {g} generated twice"
            seen[g] = True
        self.n_generated += len(groups)
        self.gen_at[groups] = self.now
        before = self.gen_prefix
        while self.gen_prefix < self.p.rollout_batch_size and seen[self.gen_prefix]:
            self.gen_prefix += 1
        self._score(groups)
        need = (self.actor.iters_done + 1) * self.p.groups_per_iter
        if self.actor.lent and before < need <= self.gen_prefix and not self.in_call:
            self.call("data_ready")   # generated, being scored: the driver asks as soon as it sees this

    def _score(self, groups: list[int]) -> None:
        for g in groups:
            heapq.heappush(self.inf_wait, g)
        self._dispatch_scoring()

    def _dispatch_scoring(self) -> None:
        """Free scoring servers take the lowest group ids waiting, as the driver's `_feed_inference` does (the
        actor's next mini-batch is a prefix of ids); while every server is busy or lent, groups wait."""
        c, p = self.c, self.p
        tp = p.inference_tp
        free, wait = self.inf_free, self.inf_wait
        while wait and free:
            free_at, k = free[0]
            if free_at > self.now + 1e-12:   # busy (its "scored" event comes then) or back from a loan ("score_free")
                return
            heapq.heappop(free)
            g = heapq.heappop(wait)
            dur = c.inference.group_time(self.group_tokens[g], tp)
            heapq.heappush(free, (self.now + dur, k))
            self.busy["inference"] += dur * tp
            self.push(self.now + dur, "scored", g)

    def try_start(self) -> None:
        a, p = self.actor, self.p
        if a.running or a.held or a.lent or a.iters_done >= p.n_minibatches:
            return
        if self.now < a.ready_at - 1e-12:
            if a.ready_pushed != a.ready_at:
                a.ready_pushed = a.ready_at
                self.push(a.ready_at, "ready")
            return
        if self.scored_prefix < (a.iters_done + 1) * p.groups_per_iter:
            return
        gt = self.group_tokens
        seq_tokens = sum(gt[a.iters_done * p.groups_per_iter:(a.iters_done + 1) * p.groups_per_iter])
        dur = self.c.actor.iter_time(float(seq_tokens), a.layout.tp, a.layout.dp, p.micro_batches)
        self.iter_tokens.append(float(seq_tokens))
        a.running, a.last_iter_s = True, dur
        self.busy["actor"] += dur * a.layout.size
        self.log("iter_start", f"iter {a.iters_done} tp{a.layout.tp} dp{a.layout.dp} ({dur:.2f}s)")
        self.push(self.now + dur, "iter_done")

    # --- the policy -------------------------------------------------------------------------------------
    def signals(self, trigger: str) -> Signals:
        if self.inst_order is None:
            self.inst_order = [self.inst[i] for i in sorted(self.inst)]
            self.packed = None
        live, now, p, a = self.inst_order, self.now, self.p, self.actor
        progress = None
        if live:
            if self.packed is None:
                k = len(live)
                self.packed = Packed(live, self.c.decode)
                self.packed_static = (np.fromiter((i.id for i in live), np.int64, k),
                                      np.fromiter((len(i.devices) for i in live), np.int64, k),
                                      np.fromiter((i.total for i in live), np.int64, k),
                                      np.fromiter((i.lent for i in live), bool, k), [i.devices for i in live])
            ids, ndev, total, lent, devices = self.packed_static
            s = self.packed.at(now)
            self.packed_q = (now, s)
            progress = RolloutProgress(ids, devices, ndev, s["started_unfinished"], s["progress"], s["queued_seqs"],
                                       s["groups_queued"], s["groups_unfinished"], s["running"], total,
                                       s["tokens"], s["rate"], lent)
        n_scored = self.n_scored
        inf = InferenceSignal(self.inf_devices, self.n_generated - n_scored, self.scored_prefix,
                              n_scored == p.rollout_batch_size, self.inf_lent)
        act = ActorSignal(a.iters_done, p.n_minibatches, not a.running and now >= a.ready_at - 1e-12,
                          a.layout, a.last_iter_s, a.lent, a.held)
        return observe(now, self.step, trigger, progress, self.length_model, inf, act, self._dev_sig,
                       p.rollout_batch_size, self.gen_prefix, self.dispatched)

    def call(self, trigger: str) -> None:
        """One consultation of the controller (`scheduler.loop`), this simulator its observations and actuator."""
        if self.policy_name == "static":
            return  # static never acts: skip building signals it would ignore
        self.in_call = True
        self.counts["decisions"] += 1
        # this decision's context for the actuator methods below
        self._moving: dict[int, float] = {}    # device -> time its old role has freed it
        self._relaying: dict[int, tuple[float, list[Work]]] = {}   # instances to re-lay: (t0, work parts)
        self.kv_paused = set()   # instances this decision's KV moves paused (charged once each)
        out = self.controller.consult(trigger, self.step, lambda: self.signals(trigger), self, lambda: self.now)
        self._relay(self._relaying)
        leftover = [d for d in self._moving if self.ledger.owner(d) is Owner.MOVING]
        self.ledger.free(leftover, "released; no taker")
        if out.actions:
            self.log("decide", f"{trigger}: {len(out.actions)} actions")
            self._sync_owners()
        self.actor.held = out.held
        self.in_call = False

    def _record(self, kind: str, **fields: Any) -> None:
        """The controller's events as the event list keeps them: a line per decided action."""
        if kind == "decision":
            for line in fields["actions"]:
                self.log("action", line)

    def _presettle(self, ids, pending: dict) -> None:
        """Open every instance in `ids` (first-touch order) for changes in one vectorised settle."""
        todo = [i for i in dict.fromkeys(ids) if i not in pending]
        if not todo:
            return
        now = self.now
        insts = [self.inst[i] for i in todo]
        pk: Packed | None = self.packed
        q: tuple[float, dict | None] | None = self.packed_q
        if pk is None or q is None or q[0] != now or not all(id(i) in pk.pos for i in insts):
            pk, q = None, (now, None)   # the decision's snapshot does not cover them: pack these alone
        for inst, (due, rest, tok) in zip(insts, settle_many(insts, now, self.c.decode, pk, q[1])):
            inst.settled(now, tok)
            self.generated_groups(due)
            pending[inst.id] = (max(now, inst.ready_at, inst.e.t0 if inst.e.n else now), [rest])

    def _pending(self, inst: Instance, pending: dict) -> tuple[float, list[Work]]:
        """The instance's unfinished work at now, opened for changes by this decision (settled once)."""
        if inst.id not in pending:
            now = self.now
            inst.close_epoch(now)
            due, rest = inst.settle(now)
            self.generated_groups(due)
            pending[inst.id] = (max(now, inst.ready_at, inst.e.t0 if inst.e.n else now), [rest])
        return pending[inst.id]

    def _migrate(self, src_id: int, dst_id: int, count: int, kv: bool, pending: dict) -> None:
        c, now = self.c, self.now
        src, dst = self.inst[src_id], self.inst[dst_id]
        t_src, parts = self._pending(src, pending)
        kept, out = src.split_last_groups(now, count, Work.cat(parts))
        pending[src.id] = (t_src, [kept])
        if not len(out):
            return
        t_dst, dparts = self._pending(dst, pending)
        groups = list(dict.fromkeys(out.gid.tolist()))
        tokens = float(out.prog.sum()) + len(out) * self.spec.prompt_tokens
        if kv:   # a decision's KV moves run as waves of batched calls: every instance in them pauses once
            cost = c.kv_move_time(tokens) - (c.kv_fixed_s if dst.id in self.kv_paused else 0.0)
            if src.id not in self.kv_paused:
                pending[src.id] = (t_src + c.kv_fixed_s, [kept])
            self.kv_paused.update((src.id, dst.id))
        else:
            cost = c.migration_time(tokens)
        dst.total += len(out)
        dst.queue += groups
        # the target's engine puts imported sequences first in its waiting queue (`import_state`): the started
        # ones run right after its own running sequences, before the sequences it has not started
        mine = Work.cat(dparts)
        pending[dst.id] = (t_dst + cost, [_started(mine, True), _started(out, True), _started(mine, False),
                                          _started(out, False)])
        self.counts["migrations"] += 1
        self.counts["groups_migrated"] += len(groups)

    # --- the actuator (scheduler.reconcile.Actuator): each action moves simulated instances and devices ------
    def wait(self, a: Wait) -> None:
        if a.recheck_s:
            self.push(self.now + a.recheck_s, "tick")

    def migrate_requests(self, a: MigrateRequests) -> None:
        self._migrate(a.src, a.dst, a.count, a.kv, self._relaying)

    def migrate_batch(self, a: MigrateBatch) -> None:
        self._presettle([i for m in a.moves for i in m[:2]], self._relaying)
        for src, dst, count in a.moves:
            self._migrate(src, dst, count, a.kv, self._relaying)

    def _finish_instances(self, a: ReleaseRollout | ReturnFromRollout, delay: float) -> None:
        self._presettle(a.instance_ids, self._relaying)
        for iid in a.instance_ids:
            inst = self.inst[iid]
            left = sum(len(w) for w in self._relaying.pop(iid)[1])
            assert left == 0, f"{type(a).__name__} of instance {iid} with {left} sequences left"
            del self.inst[iid]
            self.inst_order = self.packed = None
            self.busy["rollout"] += inst.busy_s * len(inst.devices)
        self.ledger.release(a.devices, a.reason)
        for d in a.devices:
            self._moving[d] = self.now + delay

    def release_rollout(self, a: ReleaseRollout) -> None:
        self._finish_instances(a, self.c.rollout_release_s)

    def return_from_rollout(self, a: ReturnFromRollout) -> None:
        delay = self.c.return_s
        self._finish_instances(a, delay)
        self.ledger.land(a.devices, Owner.ACTOR, a.reason)
        self.actor.lent = False
        self.actor.ready_at = max(self.actor.ready_at, self.now + delay)

    def release_inference(self, a: ReleaseInference) -> None:
        assert self.n_scored == self.p.rollout_batch_size, "inference released before it finished"
        self.ledger.release(a.devices, a.reason)
        for d in a.devices:
            self._moving[d] = self.now + self.c.inference_release_s
        self.inf_devices = ()

    def reshard_actor(self, a: ReshardActor) -> None:
        act, now, moving = self.actor, self.now, self._moving
        assert a.from_layout == act.layout, f"reshard from {a.from_layout} but the actor is {act.layout}"
        assert not act.running, "reshard while an iter runs"
        new, old = set(a.to_layout.devices), set(act.layout.devices)
        leaving = sorted(old - new)
        self.ledger.release(leaving, a.reason)
        joining = sorted(new - old)
        landing = [d for d in joining if self.ledger.owner(d) is Owner.MOVING]
        self.ledger.land(landing, Owner.ACTOR, a.reason)
        self.ledger.assign([d for d in joining if d not in landing], Owner.ACTOR, a.reason)
        dur = self.c.reshard.time(a.from_layout.devices, a.from_layout.dp, a.to_layout.devices,
                                  a.to_layout.dp, a.to_layout.tp)
        for d in leaving:
            moving[d] = now + dur   # free once the actor's state has moved off them
        wait = max([moving.get(d, now) for d in joining] + [now])
        act.layout = a.to_layout
        act.ready_at = max(act.ready_at, wait + dur)
        self.counts["reshards"] += 1

    def lend_to_rollout(self, a: LendToRollout) -> None:
        self.ledger.release(a.devices, a.reason)
        self.ledger.land(a.devices, Owner.ROLLOUT, a.reason)
        made = self._new_instances(a.devices, lent=True, ready_at=self.now + self.c.lend_s)
        assert sorted(a.instance_ids) == sorted(d for d in self.inst if self.inst[d].lent)
        self.actor.lent = True
        if self.dispatched:     # mid-step: the new instances wait for migrated work
            for inst in made:
                self._relaying[inst.id] = (inst.ready_at, [])

    def start_rollout(self, a: StartRollout) -> None:
        ready = max([self._moving.get(d, self.now) for d in a.devices] + [self.now]) + self.c.lend_s
        landing = [d for d in a.devices if self.ledger.owner(d) is Owner.MOVING]
        self.ledger.land(landing, Owner.ROLLOUT, a.reason)
        self.ledger.assign([d for d in a.devices if d not in landing], Owner.ROLLOUT, a.reason)
        for inst in self._new_instances(a.devices, lent=False, ready_at=ready):
            self._relaying[inst.id] = (ready, [])

    def lend_inference(self, a: LendInference) -> None:
        p = self.p
        servers = {p.inference_devices.index(d) for d in a.devices}
        assert all(k % p.inference_tp == 0 for k in servers), "lend whole inference instances"
        busy_until = max([f for f, k in self.inf_free if k in servers] + [self.now])
        self.inf_free = [(f, k) for f, k in self.inf_free if k not in servers]
        heapq.heapify(self.inf_free)
        self.ledger.release(a.devices, a.reason)
        self.ledger.land(a.devices, Owner.ROLLOUT, a.reason)
        self.inf_lent = tuple(sorted(self.inf_lent + a.devices))
        self.inf_devices = tuple(d for d in self.inf_devices if d not in a.devices)
        made = self._new_instances(a.devices, lent=False, ready_at=busy_until + self.c.lend_s)
        assert sorted(i.id for i in made) == sorted(a.instance_ids)
        if self.dispatched:
            for inst in made:
                self._relaying[inst.id] = (inst.ready_at, [])

    def return_to_inference(self, a: ReturnToInference) -> None:
        now, p, pending = self.now, self.p, self._relaying
        for iid in a.instance_ids:
            inst = self.inst[iid]
            if iid in pending:
                left = sum(len(w) for w in pending.pop(iid)[1])
            else:
                due, rest = inst.settle(now)
                self.generated_groups(due)
                left = len(rest)
            assert left == 0, f"ReturnToInference of instance {iid} with {left} sequences left"
            del self.inst[iid]
            self.inst_order = self.packed = None
            inst.close_epoch(now)
            self.busy["rollout"] += inst.busy_s * len(inst.devices)
        self.ledger.release(a.devices, a.reason)
        self.ledger.land(a.devices, Owner.INFERENCE, a.reason)
        self.inf_lent = tuple(d for d in self.inf_lent if d not in a.devices)
        self.inf_devices = tuple(sorted(self.inf_devices + a.devices))
        for d in a.devices:
            k = p.inference_devices.index(d)
            if k % p.inference_tp == 0:
                heapq.heappush(self.inf_free, (now + self.c.return_s, k))
        self.push(now + self.c.return_s, "score_free")


def simulate(cfg: TidalConfig | SimSpec, policy: str | None = None, devices: int | None = None, steps: int = 1,
             seed: int = 0, keep_events: bool = True) -> SimResult:
    """Simulate `steps` RL steps of `cfg` under `policy` (default: the config's `scheduler.policy`)."""
    if isinstance(cfg, SimSpec):
        spec = cfg.scaled(devices) if devices is not None and devices != cfg.num_devices else cfg
    else:
        spec = SimSpec.from_config(cfg, devices)
        policy = policy or cfg.scheduler.policy
    policy = policy or "tidal"
    if steps < 1:
        raise TidalError("--steps", steps, "must be at least 1", "e.g. --steps 10")
    t0 = _time.perf_counter()
    sim = _Sim(spec, policy, seed, keep_events)
    stats = [sim.run_step(s) for s in range(steps)]
    total = sum(s.time_s for s in stats)
    useful = sum(sim.busy.values())
    return SimResult(spec.name, policy, spec.num_devices, tuple(stats), total,
                     1.0 - useful / (spec.num_devices * total), dict(sim.busy), tuple(sim.events),
                     _time.perf_counter() - t0, seed)
