"""One RL training run on device workers: stream prompt groups rollout -> inference -> actor, step by step.

The driver owns the step's work (`StepState`, what it measured in `StepMeasurements`) and the event loop; workers
own the state (see `tidal.workers.roles`), reached through their typed endpoints (`tidal.workers.endpoints`).
The actuator owns the placement (`placement`: a frozen snapshot). Everything the scheduler decides goes through
the control loop (`tidal.pipeline.control`: observe -> decide -> reconcile through `RayActuator`), so a static
run is simply a run whose policy never acts. The middle of a run, drawn: docs/middle.md.

Who waits on whom, within a step::

    driver queue ──groups──► rollout_run (each instance, time slices)  ──finished groups──┐
                                                                                           v
    actor_train_iter(k) ◄──iter k's samples (whole groups, group-id order)── inference_score (what arrived)
          │ at every iter boundary: observe -> policy -> reconcile (migrate, release, reshard)
          v after the last iter
    weights -> rollout + inference (version + 1: `tidal.pipeline.generations`); actor back to its homes; evaluate

Determinism: iter k always trains on the sequences [k*S/n, (k+1)*S/n) of the step in group-id order, and the
actor sums micro-batch gradients in index order, so a dynamic run updates exactly like a static one; only
wall time changes. Sampling seeds derive from (run seed, step, group id, sample index), so migration does not
change a single token.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from scheduler.loop import Policy
from scheduler.state import SchedState
from tidal.core.config import TidalConfig
from tidal.core.devices import DeviceLedger, Owner
from tidal.engine.actor import ITER_PHASES
from tidal.engine.datasets import DataPosition
from tidal.engine.evaluation import EvalItem
from tidal.engine.groups import growth_rank_sets
from tidal.engine.grpo import count_response_tokens, flatten_groups, group_width, step_metrics
from tidal.engine.hf_checkpoint import HFWeights
from tidal.engine.layout import Layout
from tidal.engine.prompt_source import PromptSource
from tidal.engine.records import RolloutGroup, ScoredGroup
from tidal.pipeline.actuator import RayActuator
from tidal.pipeline.ahead import Ahead, step_groups
from tidal.pipeline.cluster import CallKind, Cluster, Flight, StepResult, StepState, StepTrace
from tidal.pipeline.control import ControlLoop
from tidal.pipeline.faults import Recovery, overdue
from tidal.pipeline.generations import Generations
from tidal.pipeline.placement import Homes, LivePlacement
from tidal.pipeline.rejoin import Rejoin
from tidal.pipeline.sharing import Sharing
from tidal.pipeline.timeline import Timeline
from tidal.workers.errors import WorkerDied
from tidal.workers.gc_pauses import GcPauses
from tidal.workers.messages import RolloutReport
from tidal.workers.roles import RunSpec, actor_micro_batches
from tidal.workers.rollout_instance import PromptGroup
from tidal.workers.runtime import CallHandle, WorkerGroup

if TYPE_CHECKING:
    pass

log = logging.getLogger("tidal.pipeline")
#: how often the step's loop looks for dead workers that have no call in flight (local workers: a look at /proc)
CHECK_EVERY_S = 0.5


def scoring_calls(queue: list[int], idle: int, busy: int, urgent: set[int], reserve: bool) -> list[int]:
    """How many groups of the scoring queue (ids, sorted) each idle inference device takes now, in order.

    At most 2 groups a call: short calls keep results flowing and keep a world-collective reshard from waiting
    seconds for a long scoring batch to drain. With `reserve` (groups of the actor's next mini-batch, `urgent`,
    are still generating) a call takes only urgent groups, or else one later group, on one device at a time:
    the others stay free for the mini-batch's last groups (without the reserve the last group of mini-batch 0
    waits 0.1-0.18 s behind later groups' 2-group calls when lent instances run those in the first wave)."""
    per = min(2, max(1, -(-len(queue) // max(1, idle))))
    out, i = [], 0
    for _ in range(idle):
        if i >= len(queue):
            break
        take = min(per, len(queue) - i)
        if reserve:   # the queue's urgent groups lead it (every earlier id is scored)
            lead = next((j for j in range(take) if queue[i + j] not in urgent), take)
            if not lead and busy:
                break
            take = lead or 1
        out.append(take)
        i += take
        busy += 1
    return out


class Pipeline:
    """A training run's driver. `policy(state, signals, now) -> actions` is consulted at actor iter boundaries."""

    def __init__(self, cfg: TidalConfig, group: WorkerGroup, spec: RunSpec,
                 weights: dict[str, torch.Tensor] | HFWeights, policy: Policy, sched_state: SchedState,
                 source: PromptSource, clock: Callable[[], float] | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None):
        t0 = time.monotonic()
        self.clock = clock or (lambda: time.monotonic() - t0)
        self.cfg, self.group, self.spec = cfg, group, spec
        self.policy, self.sched_state = policy, sched_state
        self.on_event = on_event or (lambda ev: None)
        self.source = source   # engine.prompt_source: the RL stream and the held-out prompts
        self.actor_build = ""   # what the actor's ranks built (`ActorBackend.build`), set by `start`
        p = cfg.placement
        tp = cfg.actor.tensor_parallel_size
        self.ledger = DeviceLedger(range(p.num_devices), self.clock)
        self.timeline = Timeline()
        self.cluster = Cluster(group, self.ledger, self.timeline, self.clock)
        c = self.cluster
        self.calls = c.endpoints   # every role's typed calls
        #: the owner of the placement (`placement`): every move, restore and loss goes through it
        self.actuator = RayActuator(c, lambda devices: c.drain(self._on_result, devices),
                                    lambda d: (self.generations.weights_for(d), self.generations.version),
                                    Homes(Layout(tp, len(p.actor) // tp, p.actor), p.rollout, p.inference),
                                    lambda loads: self.generations.peer_sends(loads))
        #: static placements whose components share devices: who waits for whom there (tidal.pipeline.sharing)
        self.sharing = Sharing.of(p, cfg.actor)
        self.data_pos = DataPosition()
        self._next_pos = DataPosition()   # the stream's position after the running step's prompts
        #: the initial weights until start() has sent them: global tensors, or a checkpoint each worker reads itself
        self._weights: dict[str, torch.Tensor] | HFWeights | None = weights
        #: the policy versions the engines run (`tidal.pipeline.generations`)
        self.generations = Generations(cfg, spec, c, self.actuator, self.sharing, self.clock)
        self.control: ControlLoop | None = None  # set by start(): observe -> decide -> reconcile
        self.slice_s = 0.1  # rollout time slice: how often instances report (and can be migrated)
        self.gc = GcPauses.install()   # this process's collector pauses, reported per step
        self._next_check = 0.0         # when the step's loop next looks for dead workers
        #: an asynchronous run's groups of later steps (`algorithm.max_staleness` >= 1; tidal.pipeline.ahead)
        self.ahead = Ahead(cfg.algorithm.max_staleness, cfg.run.num_steps - 1,
                           lambda pos: self.source.take(cfg.data.rollout_batch_size, pos)) \
            if cfg.algorithm.max_staleness else None
        #: a lost rollout or inference device's work to the survivors (`tidal.pipeline.faults`)
        self._recovery = Recovery(self.cluster, self.ledger, self._on_result, self.actuator, self.ahead)
        #: replacement workers for failed devices, back to the free pool once they answer (`cluster.replace_failed`)
        self.rejoin = Rejoin(self.cluster, self.ledger, spec)

    @property
    def placement(self) -> LivePlacement:
        """Where each component is now (the actuator's snapshot)."""
        return self.actuator.placement

    @property
    def _control(self) -> ControlLoop:
        """The control loop, for the steps (`start` sets it before any)."""
        return cast(ControlLoop, self.control)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        c, g, calls = self.cluster, self.group, self.calls
        g.gather(calls.worker.setup(g.device_ids, self.spec))
        weights = self._weights
        assert weights is not None, "start() runs once"
        ref = weights if isinstance(weights, HFWeights) else g.put(weights)
        home = self.placement.homes.actor
        built = g.gather(calls.actor.init(g.device_ids, home, ref))
        self.actor_build = built[0]   # every rank builds alike (a backend's choices depend on config and machine)
        log.info("actor: %s", self.actor_build)
        # what the actuator needs to plan reshards here rather than on (capped) workers
        self.actuator.plan_reshards_with(g.gather([calls.actor.program_inputs(home.devices[0])])[0])
        self._assign_placement()
        self.generations.load(ref, step=0)
        actuator = self.actuator
        self.control = ControlLoop(self.cfg, self.policy, self.sched_state, c, self.ledger, actuator)
        if self.cfg.cluster.auto_scheduler:   # groups of every layout the actor can grow to: reshards stay local
            sets = growth_rank_sets(home, g.world_ids)
            if sets:
                secs = max(g.gather(calls.actor.make_groups(g.device_ids, sets)))
                actuator.known_rank_sets(sets)
                c.record("groups", step=0, rank_sets=len(sets), seconds=secs)
        self._weights = None
        # on every worker what exists now (model, actor state, engine, Ray's and the modules' objects) is not
        # scanned by later collections (`GcPauses`). Not here: the driver may share its process with other runs
        # (a sweep's trials), whose frozen cycles would never be freed. Its pauses are reported per step
        g.gather(calls.worker.freeze_gc(g.device_ids))
        self.gc.take()

    def _assign_placement(self) -> None:
        """The ledger at start: each device to its component, or SHARED where a static placement puts several."""
        p, owners = self.placement, {}
        for role, devices in ((Owner.ACTOR, p.actor.devices), (Owner.ROLLOUT, p.rollout),
                              (Owner.INFERENCE, p.inference)):
            for d in devices:
                owners[d] = Owner.SHARED if d in owners else role
        by_role = {role: [d for d, o in owners.items() if o is role]
                   for role in (Owner.ACTOR, Owner.ROLLOUT, Owner.INFERENCE, Owner.SHARED)}
        self.ledger.assign_many({r: ds for r, ds in by_role.items() if ds}, "placement")


    # ---- shared devices: hand-overs between generation and training -------------------------------------------


    def _to_training(self, st: StepState) -> None:
        """Once per step, before the first iter on devices the actor shares with rollout: the engines there are
        released (weights and KV; inference too where it shares them and has scored everything) and the actor's
        state comes back."""
        if st.handed_over:
            return
        st.handed_over = True
        devices = self.generations.shared_actor_devices()
        if not devices:
            return
        c, g = self.cluster, self.group
        c.drain(self._on_result, set(devices))   # the instances' last (empty) slices
        t0 = self.clock()
        hs: list[CallHandle[object]] = []
        for d in devices:
            if d in self.placement.inference and self.sharing.train_waits_for_scoring():
                hs.append(self.calls.inference.release(d))
            hs.append(self.calls.rollout.release(d))
        hand = [(d, self.calls.actor.onload(d)) for d in devices]
        g.gather(hs)
        self.generations.record_handover("to_training", hand, st.step)
        c.timeline.add_busy(devices, "moving", "hand-over", t0, self.clock())

    def _free_kv(self, st: StepState) -> None:
        """Generation is done: devices that score next free their rollout engines' KV caches (once per step)."""
        if st.kv_freed or not self.sharing.score_waits_for_rollout() or st.generated < st.num_groups:
            return
        st.kv_freed = True
        c, g = self.cluster, self.group
        devices = sorted(set(self.placement.rollout) & set(self.placement.inference))
        c.drain(self._on_result, set(devices))
        g.gather(self.calls.rollout.free_kv(devices))




    # ---- one RL step ---------------------------------------------------------------------------------------
    def run_step(self, step: int, sync: bool = True) -> StepResult:
        """Stream one step; `sync=False` leaves the weight sync to the caller (`sync_weights`, e.g. a flow task)."""
        cfg, c = self.cfg, self.cluster
        t_start = self.clock()
        if self.generations.unsynced:   # our invariant: the caller of run_step(sync=False) syncs before the next step
            raise RuntimeError("run_step: the previous step's weights were never synced (call sync_weights after "
                               "run_step(sync=False))")
        early = self.ahead.pop(step) if self.ahead is not None else None
        if early is None:
            prompts, next_pos = self.source.take(cfg.data.rollout_batch_size, self.data_pos)
            groups = step_groups(step, prompts)
            st = StepState(step, deque(groups), len(groups), {g.group_id: g for g in groups}, t_start=t_start)
        else:   # generated ahead in part (an asynchronous run): in flight stays given, generated is scored first
            next_pos = early.next_pos
            st = StepState(step, early.queue, len(early.groups), early.groups, given=dict(early.given),
                           t_start=t_start)
            carried = [early.generated[gid] for gid in sorted(early.generated)]
            st.generated = len(carried)
            st.gen_time.update((r.group_id, t_start) for r in carried)
            st.to_score.extend(carried)
            st.measured.work["rollout/groups_generated_ahead"] = float(len(carried))
        self.step_state = st
        self._next_pos = next_pos
        self._control.consult("start", st)
        n = cfg.algorithm.n_minibatches
        while st.iters_done < n:
            try:
                self._stream_once(st)
            except WorkerDied as died:   # a rollout or inference device: its work goes to the survivors
                self._lost(died, st)
            self._check_overdue(st)
        c.drain(self._on_result)
        self.rejoin.poll(step)   # a device back by now takes its place in the next step (the restore below)
        self.generations.keep_at_step_end()
        self._control.end_step(st)
        if sync:
            self.generations.sync(step)
        self.data_pos = next_pos
        metrics = {**step_metrics(list(st.scored.values())), **st.measured.metrics(st.iters_done)}
        seconds = self.clock() - t_start
        metrics["step/time_s"] = seconds
        metrics["step/idle_fraction"] = self.idle_fraction(t_start)
        metrics["driver/gc_s"], metrics["driver/gc_max_s"], _ = self.gc.take()
        metrics["step/tokens_per_s"] = sum(len(r) for g in st.scored.values() for r in g.response_ids) / seconds
        events = [e for e in c.events if e["time"] >= t_start]
        ids = sorted(st.scored)
        trace = StepTrace(step, seconds, max(st.gen_time.values(), default=t_start) - t_start,
                          max(st.score_time.values(), default=t_start) - t_start,
                          [[len(r) for r in st.scored[g].response_ids] for g in ids],
                          [len(st.scored[g].prompt_ids) for g in ids])
        return StepResult(step, seconds, metrics, self._phase_seconds(t_start), events, trace)

    def _stream_once(self, st: StepState) -> None:
        """One pass of the step's loop: feed, train when ready, handle what came back."""
        c = self.cluster
        # scoring first: its calls run on the inference workers while the policy's actions (which touch
        # neither those devices nor what they score) hold the driver; fed after them, the last group of a
        # mini-batch waited for the moves its generation triggered (host e2e run: scored 0.35 s after it was
        # generated, static 0.16 s). Then the policy (its actions drain the instances they touch), then the
        # rollout feed: feeding before the policy left the drained instances without a slice until the next
        # result anywhere (up to the 0.5 s wait below; on the host e2e run 0.3-2 s of instance time per step)
        self._feed_inference()
        if not st.iter_running:
            self._maybe_train()
        self._feed_rollout()
        self._feed_inference()
        for f, res in c.wait_any(0.5):
            self._on_result(f, res)
        if self.clock() >= self._next_check:   # a dead worker with no call in flight is found here
            self._next_check = self.clock() + CHECK_EVERY_S
            self.group.check()
            self.rejoin.poll(st.step)

    def _lost(self, died: WorkerDied, st: StepState, overdue_s: float | None = None) -> None:
        """A device's worker is gone: its work to the survivors (or the run stops, `Recovery.recover`), and with
        `cluster.replace_failed` a replacement worker is asked for."""
        failure = self._recovery.recover(died, st, overdue_s)
        if self.cfg.cluster.replace_failed:
            self.rejoin.start(failure)

    def _check_overdue(self, st: StepState) -> None:
        """A rollout or inference call with no result within `cluster.failure_timeout_s`: its worker is hung;
        killed and recovered like a dead one."""
        timeout = self.cfg.cluster.failure_timeout_s
        late = overdue(self.cluster, self.clock(), timeout)
        if late is None:
            return
        d, secs = late
        reason = f"no result within cluster.failure_timeout_s={timeout:g}s ({secs:.1f}s)"
        self.group.fail(d, reason)
        self._lost(WorkerDied(d, reason), st, overdue_s=secs)

    def idle_fraction(self, t0: float = 0.0) -> float:
        self._close_ownership()
        return self.timeline.idle_fraction(t0, self.clock())

    def _close_ownership(self) -> None:
        """Ownership spans, and the spans in which a device was FAILED, from the ledger history (recomputed; cheap
        at these sizes)."""
        now = self.clock()
        self.timeline.owned, self.timeline.down = [], []
        open_: dict[int, tuple[str, float]] = {}
        down: dict[int, tuple[str, float]] = {}
        for tr in self.ledger.history:
            if tr.device in open_:
                role, since = open_.pop(tr.device)
                self.timeline.add_owned([tr.device], role, since, tr.time)
            if tr.device in down:
                reason, since = down.pop(tr.device)
                self.timeline.add_down(tr.device, reason, since, tr.time, rejoined=True)
            if tr.dst is Owner.FAILED:
                down[tr.device] = (tr.reason, tr.time)
            elif tr.dst is not Owner.FREE:   # a failed device is in no role: not owned, not idle
                open_[tr.device] = (tr.dst.value, tr.time)
        for d, (role, since) in open_.items():
            self.timeline.add_owned([d], role, since, now)
        for d, (reason, since) in down.items():
            self.timeline.add_down(d, reason, since, now, rejoined=False)

    def _phase_seconds(self, t0: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.timeline.busy:
            if s.t1 >= t0:
                out[s.role] = out.get(s.role, 0.0) + s.t1 - max(s.t0, t0)
        return out

    # ---- feeding components ----------------------------------------------------------------------------------
    def _capacity_groups(self) -> int:
        """Groups an instance may hold: its slots' worth, plus as many again waiting. A group keeps its slots'
        share until its longest sample ends, so with only a slots' worth given, freed slots stayed empty until
        the next feed (measured: ~6 of 16 slots busy on the CPU e2e workload); the waiting backlog refills them at
        once. Work still moves between instances (migration) and the step's queue stays shared."""
        return 2 * max(1, self.cfg.rollout.max_running_requests // self.cfg.algorithm.group_size)

    def _feed_rollout(self) -> None:
        """Instances pull whole groups from the step's one queue: up to their capacity, and no more than a fair
        share of what is left, so early pullers do not take everything. Groups are dealt round robin (lowest ids
        first, one per instance per round), so each instance's first wave holds the lowest ids: the actor trains
        iter k on a prefix of group ids, and with consecutive ids per instance (0-3 on one, 4-7 on the next) half
        of mini-batch 0 waited for a second wave while later mini-batches ran in the first.

        An instance with work keeps `rollout.slices_ahead` time slices queued: the next one starts on the worker
        the moment the current one returns, instead of after the result's round trip through the driver and
        whatever the driver does meanwhile (applying a scheduler action: 0.1-0.7 s per step, instances stalled)."""
        st, c = self.step_state, self.cluster
        rollout = self.placement.rollout
        slices_ahead = self.cfg.rollout.slices_ahead
        room = {inst: slices_ahead - c.calls(inst, CallKind.ROLLOUT) for inst in rollout}
        open_ = [inst for inst in rollout if room[inst] > 0]
        give: dict[int, list[PromptGroup]] = {inst: [] for inst in open_}
        cap = self._capacity_groups()
        later = self.ahead.given_to if self.ahead is not None else (lambda inst: 0)

        def deal(queue: deque[PromptGroup], given: Callable[[int], int]) -> dict[int, int]:
            share = -(-len(queue) // max(1, len(rollout)))
            dealt, took = True, dict.fromkeys(open_, 0)
            while queue and dealt:
                dealt = False
                for inst in open_:
                    if queue and took[inst] < share and given(inst) + len(give[inst]) < cap:
                        give[inst].append(queue.popleft())
                        took[inst] += 1
                        dealt = True
            return took

        took = deal(st.queue, lambda inst: st.given.get(inst, 0) + later(inst))
        if self.ahead is not None and not st.queue:   # the step's own groups all dealt: later steps' next
            for a in self.ahead.dealable(st.step, self.generations.version, self._next_pos):
                for inst, n in deal(a.queue, lambda inst: st.given.get(inst, 0) + later(inst)).items():
                    a.dealt(inst, n)
        now = self.clock()
        for inst in open_:
            if not give[inst] and st.given.get(inst, 0) + later(inst) == 0:
                continue  # nothing to do there
            st.given[inst] = st.given.get(inst, 0) + took[inst]
            st.total_given[inst] = st.total_given.get(inst, 0) + took[inst] * self.cfg.algorithm.group_size
            if inst in st.waiting_since:
                gap = now - st.waiting_since.pop(inst)
                st.measured.rollout_gap_s += gap
                if gap > 0.25:
                    log.info("instance %d held %d groups with no slice for %.2fs", inst, st.given.get(inst, 0), gap)
            c.submit_slice(inst, give[inst], self.slice_s)

    def _feed_inference(self) -> None:
        st, c = self.step_state, self.cluster
        if self.sharing.score_waits_for_rollout():   # the devices generate first (scoring is on all of them)
            if st.generated < st.num_groups:
                return
            self._free_kv(st)
        inference = self.placement.inference
        idle = [d for d in inference if not c.busy(d)]
        if not st.to_score or not idle:
            return
        st.to_score.sort(key=lambda g: g.group_id)  # lowest ids first: the actor's next mini-batch is a prefix
        k = st.iters_done + (1 if st.iter_running else 0)
        nxt = set(self._iter_groups(k)) if k < self.cfg.algorithm.n_minibatches else set()
        takes = scoring_calls([g.group_id for g in st.to_score], len(idle), len(inference) - len(idle), nxt,
                              reserve=len(inference) > 1 and any(gid not in st.gen_time for gid in nxt))
        for d, take in zip(idle, takes):
            batch = st.to_score[:take]
            # submitted before the groups leave the queue: a worker found dead here raises WorkerDied with its
            # groups still queued for the survivors (taken first, they were in no queue and no call: lost)
            handle = self.calls.inference.score(d, batch)
            st.to_score = st.to_score[take:]
            st.scoring += len(batch)
            c.track(CallKind.INFERENCE, handle, payload=batch)

    def _iter_groups(self, k: int) -> list[int]:
        g, n = self.cfg.algorithm.group_size, self.cfg.algorithm.n_minibatches
        seqs = self.step_state.num_groups * g
        lo, hi = k * seqs // n, (k + 1) * seqs // n
        return list(range(lo // g, (hi - 1) // g + 1))

    def iter_ready(self) -> bool:
        st = self.step_state
        return all(gid in st.scored for gid in self._iter_groups(st.iters_done))

    def _maybe_train(self) -> None:
        st = self.step_state
        ready = self.iter_ready()
        # generated, not yet scored: the policy may move devices now, while its last groups are scored
        generated = ready or all(gid in st.gen_time for gid in self._iter_groups(st.iters_done))
        if not self._control.consult("boundary", st, data_ready=ready, data_generated=generated):
            st.held = True
            return
        st.held = False
        if not ready:
            return
        share = self.sharing
        if share.train_waits_for_rollout() and (st.generated < st.num_groups or (
                share.train_waits_for_scoring() and len(st.scored) < st.num_groups)):
            return   # its devices generate (and score) first: the step's phases run in turn there
        self._to_training(st)
        if self.placement.actor_lent_out:
            if st.generated < st.num_groups:
                return   # its devices host rollout instances: the actor trains once the policy takes them back
            self._control.return_lent("rollout is done: lent devices go back to the actor")
            return   # the next pass asks the policy again, with the devices back, before the iter starts
        k, g, n = st.iters_done, self.cfg.algorithm.group_size, self.cfg.algorithm.n_minibatches
        gids = self._iter_groups(k)
        samples = flatten_groups([st.scored[i] for i in gids])
        seqs = st.num_groups * g
        lo, hi = k * seqs // n - gids[0] * g, (k + 1) * seqs // n - gids[0] * g
        samples = samples[lo:hi]
        ref = self.group.put(samples)
        st.iter_running = True
        st.iter_tokens = float(sum(len(x.prompt_ids) + len(x.response_ids) for x in samples))
        st.measured.add_work("work/actor_tokens", sum(len(idx) * width for idx, width in
                                                      actor_micro_batches(self.spec, samples)))
        for h in self.calls.actor.train_iter(self.placement.actor.devices, ref, count_response_tokens(samples)):
            self.cluster.track(CallKind.ACTOR, h, payload=k)

    # ---- results ------------------------------------------------------------------------------------------
    def _on_result(self, f: Flight, res: Any) -> None:
        match f.kind:
            case CallKind.ROLLOUT:
                self._on_slice(f, *res)
            case CallKind.INFERENCE:
                self._on_scored(f, res)
            case CallKind.ACTOR:
                self._on_actor_rank(f, res)

    def _on_slice(self, f: Flight, records: list[RolloutGroup], report: RolloutReport) -> None:
        st, c, now = self.step_state, self.cluster, self.clock()
        st.reports[f.device] = report
        # the call's own span: from its submission, or from the result of the call it was queued behind
        t0 = max(f.t0, st.last_result.get(f.device, f.t0))
        st.last_result[f.device] = now
        if report.call_tokens > 0:   # seconds per decode step as the driver sees it: call overhead,
            b = report.mean_batch    # admissions and the machine's contention included
            st.measured.decode_samples.append((b, (now - t0) * b / report.call_tokens))
        if report.pumps > 0:
            st.measured.pump_samples.append(report.busy_s / report.pumps)
        c.timeline.add_busy([f.device], "rollout", "generate", t0, now)
        if self.ahead is not None:   # later steps' groups wait for their step (module tidal.pipeline.ahead)
            self.ahead.arrived(f.device, [r for r in records if r.step != st.step])
            records = [r for r in records if r.step == st.step]
        st.given[f.device] = max(0, st.given.get(f.device, 0) - len(records))
        st.measured.rollout_busy_s += report.busy_s
        st.measured.rollout_gc_s += report.gc_s
        st.measured.reward_timeouts += report.reward_timeouts
        st.measured.add_work("work/rollout_kv_read_tokens", report.call_keys_read)
        st.measured.add_work("work/rollout_prefill_tokens", report.call_prefill_tokens)
        st.measured.add_work("work/rollout_preemptions", report.call_preemptions)
        st.measured.rollout_call_s += now - t0
        later = self.ahead.given_to(f.device) if self.ahead is not None else 0
        if st.given[f.device] + later and not c.calls(f.device, CallKind.ROLLOUT):
            st.waiting_since[f.device] = now
        st.generated += len(records)
        st.gen_time.update((r.group_id, now) for r in records)
        st.to_score.extend(records)
        self._recovery.generated(records, st.step)

    def _on_scored(self, f: Flight, scored: list[ScoredGroup]) -> None:
        st, now = self.step_state, self.clock()
        self.cluster.timeline.add_busy([f.device], "inference", "score", f.t0, now)
        st.scoring -= len(f.payload)
        st.measured.score_samples.append((len(scored), float(sum(len(g.prompt_ids) * len(g.response_ids)
                                                        + sum(len(r) for r in g.response_ids) for g in scored)),
                                 now - f.t0))
        st.measured.add_work("work/inference_tokens",
             sum(len(g.response_ids) * group_width(g, self.spec.args.max_seq_len) for g in scored))
        for g in scored:
            assert g.group_id not in st.scored, f"group {g.group_id} scored twice"
            st.scored[g.group_id] = g
            st.score_time[g.group_id] = now
        self._recovery.scored(scored, st.step)

    def _on_actor_rank(self, f: Flight, metrics: dict[str, float] | None) -> None:
        st, c, now = self.step_state, self.cluster, self.clock()
        c.timeline.add_busy([f.device], "actor", f"iter {f.payload}", f.t0, now)
        if metrics is not None:
            st.measured.actor_metrics.append(metrics)
            st.iter_ranks.append(metrics)
        if any(x.kind is CallKind.ACTOR for x in c.inflight.values()):
            return   # the iter ends with its last rank
        st.iter_running = False
        st.iters_done += 1
        st.last_iter_s = now - f.t0
        lay = self.placement.actor
        st.measured.iter_samples.append((lay.tp, lay.dp, st.iter_tokens, st.last_iter_s))
        # where the iter went, slowest rank per phase (compute / sync / update / publish: tidal/engine/actor.py)
        phases = {p: max(r[f"actor/iter_{p}_s"] for r in st.iter_ranks if f"actor/iter_{p}_s" in r)
                  for p in ITER_PHASES if any(f"actor/iter_{p}_s" in r for r in st.iter_ranks)}
        # when its mini-batch was generated and scored, and when the iter started (from the step's start):
        # the critical path's first segment, and how long the iter waited for the devices' moves
        gids = self._iter_groups(f.payload)
        since = {"generated": max(st.gen_time[i] for i in gids), "scored": max(st.score_time[i] for i in gids),
                 "started": f.t0}
        # the iter's loss as the step metric averages it (over ranks), its gradient norm (global: any rank's)
        loss = [r["actor/loss"] for r in st.iter_ranks if "actor/loss" in r]
        norm = [r["actor/grad_norm"] for r in st.iter_ranks if "actor/grad_norm" in r]
        c.record("iter", step=st.step, iter=f.payload, tp=lay.tp, dp=lay.dp, seconds=st.last_iter_s,
                 tokens=st.iter_tokens, phases_s=phases, at_s={k: round(v - st.t_start, 4) for k, v in since.items()},
                 loss=sum(loss) / len(loss) if loss else None, grad_norm=max(norm) if norm else None)
        st.iter_ranks = []

    # ---- end of step ----------------------------------------------------------------------------------------




    @property
    def version(self) -> int:
        """The policy version the engines run."""
        return self.generations.version

    def sync_weights(self, step: int) -> None:
        """The actor's weights to every engine (the next policy version): `Generations.sync`."""
        self.generations.sync(step)

    def global_weights(self) -> dict[str, torch.Tensor]:
        """Current actor weights in global coordinates (for checks and checkpoints of the driver)."""
        return self.generations.global_weights()

    def evaluate(self, items: list[EvalItem]) -> float:
        """Greedy held-out accuracy of `items` under the weights inference holds."""
        return float(self.group.gather([self.calls.inference.evaluate(self.placement.inference[0], items)])[0])


