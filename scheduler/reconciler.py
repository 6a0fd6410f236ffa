"""The reconciler: turns a policy's actions into moves on real workers, keeps device ownership consistent, and
records every decision and action.

    pipeline (iter boundary / step start / step end)
        └─► Reconciler.consult(trigger)
              signals = snapshot of rollout / inference / actor / ledger       (typed, timestamped)
              actions = policy(state, signals, now)                             (pure; same code as the simulator)
              for each action: apply -> outcome (ok | failed: reason), one event each
        ◄── proceed? (False while the policy says Wait)

Ownership rules (tidal.devices): a device leaves its role as MOVING and becomes FREE only after its old role
freed it; a device joins a role only from FREE. A failed action leaves the cluster as it was before that action
(migration is two-phase, resharding rolls back inside the engine) and the ledger moves are undone; the failure
is recorded with its reason and the run goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from tidal.devices import Owner
from tidal.engine.groups import layout_rank_sets, reshard_rank_sets
from tidal.engine.layout import Layout
from tidal.scheduler.actions import (Action, LendInference, LendToRollout, MigrateBatch, MigrateRequests,
                                     ReleaseInference, ReleaseRollout, ReshardActor, ReturnFromRollout,
                                     ReturnToInference, StartRollout, Wait, describe)
from tidal.scheduler.costs import (learn_actor_factor, learn_decode, learn_moves, learn_reshard, learn_rollout_factor,
                                   learn_scoring)
from tidal.scheduler.estimate import LengthModel
from tidal.scheduler.signals import (ActorLayout, ActorSignal, DeviceSignal, InferenceSignal,
                                     RolloutInstanceSignal, Signals)
from tidal.workers.roles import export_receipt

if TYPE_CHECKING:  # pragma: no cover
    from tidal.pipeline.driver import Pipeline

log = logging.getLogger("tidal.scheduler")
ROLES = "tidal.workers.roles"
#: the same boundary is not asked again sooner than this (the driver asks while the actor waits)
MIN_INTERVAL_S = 0.2


def _prefix(done: dict, n: int) -> int:
    """Length of the prefix 0, 1, ... of group ids present in `done`."""
    k = 0
    while k < n and k in done:
        k += 1
    return k


#: failed actions in one step after which the policy is not consulted again until the step ends: a policy that
#: keeps asking for a move the cluster cannot make (found once: a migration's bookkeeping broke mid-way and the
#: same ReturnFromRollout failed 3,869 times) must not spin the driver; the step completes on its placement
MAX_FAILURES_PER_STEP = 5


def _move_reported(signals: dict[int, dict], src: int, dst: int, moved: dict) -> None:
    """Carry a migration's work from `src`'s last report to `dst`'s: its open groups and their sequences in the
    engine (running or waiting, with the tokens they generated); `moved` is the package's summary
    (`roles.package_summary`). Queued groups need nothing: the reports count them as given minus in progress.
    Dropping both reports instead (before) made the length model read every group `dst` held as unstarted: on
    the CPU e2e run 19 sequences left read as 88 after a 3-group move, and the policy lent the actor's devices
    to a rollout that was nearly done. Without a report for `dst`, both go and the estimate falls back to the
    given groups until the next reports."""
    a, b = signals.get(src), signals.get(dst)
    if a is None or b is None:
        signals.pop(src, None)
        signals.pop(dst, None)
        return
    seqs, tokens, opened = moved["requests"], moved["tokens"], moved["open"]
    started_a = a.get("running", 0) + a.get("waiting", 0)
    signals[src] = {**a, "running": max(0, started_a - seqs), "waiting": 0,
                    "progress": max(0, a.get("progress", 0) - tokens),
                    "groups_in_progress": max(0, a.get("groups_in_progress", 0) - opened)}
    signals[dst] = {**b, "running": b.get("running", 0) + seqs, "progress": b.get("progress", 0) + tokens,
                    "groups_in_progress": b.get("groups_in_progress", 0) + opened}


class Reconciler:
    def __init__(self, pipeline: "Pipeline", min_interval_s: float = MIN_INTERVAL_S):
        self.p = pipeline
        self.min_interval_s = min_interval_s
        self._last: tuple[str, float] | None = None
        self._held_since: float | None = None
        # what the producer learns for the policy, as the simulator does: response lengths (remaining-work and
        # tail estimates) and the readiness curve of the previous step (see `learn`)
        self.lengths = LengthModel.prior(pipeline.cfg.rollout.max_new_tokens)
        self.inf_lent: list[int] = []     # inference devices now hosting rollout instances (LendInference)
        # rank sets whose process groups every worker has made (mirrors engine.groups.GroupCache: the initial
        # layout's at actor_init, then every world-wide reshard's), and the calls not waited for (layout notes to
        # workers outside a member-local reshard, a migration wave's commits): their results are checked at step end
        init = pipeline.initial_layout
        self._rank_sets: set[tuple[int, ...]] = {tuple(sorted(r)) for r in layout_rank_sets(init) if len(r) >= 2}
        self._notes: list = []
        self._predictions: list[tuple[float, float, float, int]] = []   # rollout left, noted: see learn
        self._t_start = 0.0
        self._failures: dict[int, int] = {}   # failed actions per step: the breaker below

    def known_rank_sets(self, sets) -> None:
        """Rank sets whose groups every worker has made (outside a reshard, e.g. at start)."""
        self._rank_sets.update(tuple(sorted(r)) for r in sets if len(r) >= 2)

    # ---- signals --------------------------------------------------------------------------------------------
    def signals(self, trigger: str) -> Signals:
        p, c, st = self.p, self.p.cluster, self.p.step_state
        g = p.cfg.algorithm.group_size
        rollout = []
        insts = sorted(c.rollout)
        # per instance: sequences started (in the engine) with their progress, and sequences not started (groups
        # given but not opened yet); the length model turns them into remaining tokens and the longest tail
        started = np.zeros(len(insts))
        progress = np.zeros(len(insts))
        queued = np.zeros(len(insts))
        for k, inst in enumerate(insts):
            s, given = st.signals.get(inst, {}), st.given.get(inst, 0)
            if s and given:
                started[k] = s.get("running", 0) + s.get("waiting", 0)
                progress[k] = s.get("progress", 0)
                queued[k] = max(0, given - s.get("groups_in_progress", 0)) * g
            else:
                queued[k] = given * g
        # groups not handed out yet (the driver feeds instances a few groups at a time) are work all the same:
        # each instance will pull an even share of them. Without this the policy sees the step as nearly done
        # while most of it waits in the driver's queue (RLinf's regime: many more sequences than slots)
        if insts and st.queue:
            queued += len(st.queue) * g / len(insts)
        est = self.lengths.remaining_many(started, progress, queued)
        tail = self.lengths.tail_many(started, progress, queued)
        tail_all = self.lengths.tail_total(started, progress, queued)
        tail_started = self.lengths.tail_total(started, progress, np.zeros_like(queued))
        for k, inst in enumerate(insts):
            s, given = st.signals.get(inst, {}), st.given.get(inst, 0)
            rollout.append(RolloutInstanceSignal(
                id=inst, devices=(inst,), groups_queued=int(queued[k]) // g, groups_unfinished=given,
                running=int(started[k] + queued[k]), total=st.total_given.get(inst, 0),
                tokens_generated=s.get("tokens", 0), progress_tokens=int(progress[k]),
                token_rate=s.get("token_rate", 0.0), est_remaining_tokens=float(est[k]), lent=inst in c.lent,
                est_tail_tokens=float(tail[k])))
        done = st.generated == st.num_groups and not st.to_score and st.scoring == 0
        # the actor trains iter k on groups [k*G/n, (k+1)*G/n) in id order (determinism), so what it can use is
        # the *prefix* of groups generated / scored, not their count: report prefixes, and the policy's "mini-batch
        # j is ready when (j+1)*G/n groups are" holds exactly (a count would call it ready while group 0 still runs)
        gen_prefix = _prefix(st.gen_time, st.num_groups)
        inference = InferenceSignal(tuple(c.inference), len(st.to_score) + st.scoring,
                                    _prefix(st.scored, st.num_groups), done, tuple(self.inf_lent))
        lay = c.actor_layout
        actor = ActorSignal(st.iters_done, p.cfg.algorithm.n_minibatches, not st.iter_running,
                            ActorLayout(lay.tp, lay.dp, lay.devices), st.last_iter_s,
                            lent_out=bool(c.lent & set(lay.devices)), held=st.held)
        return Signals(p.clock(), st.step, tuple(rollout), inference, actor,
                       DeviceSignal.from_snapshot(p.ledger.snapshot()), st.num_groups, gen_prefix,
                       all_registered=not st.queue, trigger=trigger, rollout_tail_tokens=tail_all,
                       started_tail_tokens=tail_started)

    # ---- decide and act --------------------------------------------------------------------------------------
    def consult(self, trigger: str, data_ready: bool = False, data_generated: bool = False) -> bool:
        """Ask the policy; apply its actions. Returns False if the actor must wait (a `Wait` action).
        `data_ready`: the actor's next mini-batch is scored; `data_generated`: it is generated (scoring may still
        run). The first ask with either (`data_generated` while the actor's devices are lent) is never skipped: the
        policy decides then whether lent devices come back, and their moves run while the last groups are scored."""
        now = self.p.clock()
        c = self.p.cluster
        lent_out = bool(c.lent & set(c.actor_layout.devices))
        # "generated" matters only while the actor's devices are lent (the policy may take them back then)
        key = (trigger, self.p.step_state.step, self.p.step_state.iters_done, data_ready, data_generated and lent_out,
               lent_out)
        if trigger == "boundary" and self._last and self._last[0] == key and \
                now - self._last[1] < self.min_interval_s:  # same boundary asked again soon: nothing new to see
            return self._held_since is None
        self._last = (key, now)
        if trigger == "start":
            self._t_start = now
        if trigger == "step_end":
            self.restore()
            self.p.group.gather(self._notes)   # a failed note or commit is a bug: raise it here, not later
            self._notes = []
            self.learn()
            return True
        step = self.p.step_state.step
        if self._failures.get(step, 0) >= MAX_FAILURES_PER_STEP:
            return True   # breaker open: the step finishes on its current placement (the driver returns lent devices)
        sig = self.signals(trigger)
        self._note_rollout_prediction(sig, now)
        t0 = time.perf_counter()
        actions = self.p.policy(self.p.sched_state, sig, now)
        decide_s = time.perf_counter() - t0
        if actions:
            cols = sig.cols   # what the policy saw, so a decision can be checked against what happened next
            self.p.cluster.record("decision", step=sig.step, iter=sig.actor.iters_done, trigger=trigger,
                                  actions=describe(actions), decide_s=decide_s,
                                  seen={"running": int(cols.running.sum()), "groups_generated": sig.groups_generated,
                                        "groups_scored": sig.inference.groups_finished,
                                        "est_remaining_tokens": float(cols.est_remaining_tokens.sum()),
                                        "est_tail_tokens": sig.tail_tokens,
                                        "instances": int(cols.id.size)})
        wait = False
        for a in actions:
            if isinstance(a, Wait):
                wait = True
                continue
            self.apply(a, sig)
        self._held_since = (self._held_since or now) if wait else None
        return not wait

    def _note_rollout_prediction(self, sig: Signals, now: float) -> None:
        """Note what is left of this step's rollout (tokens, longest sequence, instances) now: `learn` prices it
        with the cost model and compares with when rollout really ended (at most one note per 0.25 s)."""
        if not sig.running or (self._predictions and now - self._predictions[-1][0] < 0.25):
            return
        cols = sig.cols
        self._predictions.append((now, float(cols.est_remaining_tokens.sum()), sig.tail_tokens, int(cols.id.size)))

    def apply(self, a: Action, sig: Signals) -> bool:
        c = self.p.cluster
        t0 = self.p.clock()
        try:
            extra = self._do(a)
            ok, why = True, ""
        except Exception as err:  # a failed action is recorded and the run goes on (state was rolled back)
            cause = getattr(err, "cause", "")   # a worker's error: its own line, not the Ray traceback
            ok, extra = False, {}
            why = (f"{type(err).__name__} on device {err.device_id}: {cause}" if cause else
                   f"{type(err).__name__}: {err}")[:500]
            log.warning("action %s failed: %s", type(a).__name__, why)
            n = self._failures[sig.step] = self._failures.get(sig.step, 0) + 1
            if n == MAX_FAILURES_PER_STEP:
                c.record("scheduler_paused", step=sig.step, failures=n,
                         reason=f"{n} failed actions this step: the policy is not consulted until the step ends")
        c.record("action", step=sig.step, iter=sig.actor.iters_done, action=type(a).__name__,
                 reason=a.reason, ok=ok, error=why, seconds=self.p.clock() - t0, **extra)
        return ok

    def _do(self, a: Action) -> dict:
        if isinstance(a, MigrateRequests):
            return self.migrate_many([(a.src, a.dst, a.count)])
        if isinstance(a, MigrateBatch):
            return self.migrate_many(list(a.moves))
        if isinstance(a, StartRollout):
            return self.lend(a.devices, lent=False)
        if isinstance(a, LendInference):
            return self.lend_inference(a.devices)
        if isinstance(a, ReturnToInference):
            return self.return_inference(a.instance_ids)
        if isinstance(a, ReleaseRollout):
            return self.release_rollout(a.instance_ids, a.migrate_to)
        if isinstance(a, ReturnFromRollout):
            out = self.release_rollout(a.instance_ids, a.migrate_to, back_to=Owner.ACTOR)
            self.p.cluster.lent -= set(a.instance_ids)
            return out
        if isinstance(a, ReleaseInference):
            return self.release_inference(a.devices)
        if isinstance(a, ReshardActor):
            t = a.to_layout
            return self.reshard(Layout(t.tp, t.dp, tuple(t.devices)))
        if isinstance(a, LendToRollout):
            return self.lend(a.devices)
        raise TypeError(f"no actuator for {type(a).__name__}")

    # ---- actuators ------------------------------------------------------------------------------------------
    def _idle(self, devices) -> None:
        self.p.cluster.drain(self.p._on_result, set(devices))

    def migrate(self, src: int, dst: int, count: int | None) -> dict:
        """Move `count` unfinished groups (None: all) of instance `src` to `dst`, two-phase, KV included."""
        return self.migrate_many([(src, dst, count)])

    def migrate_many(self, moves: list[tuple[int, int, int | None]]) -> dict:
        """Apply `moves` [(src, dst, count)] with the result of applying them one by one, in rounds of concurrent
        calls instead of three sequential calls per move.

        Moves are cut into waves, in order, so that no device of a wave is both a source and a target: a wave's
        sources then export exactly what they would have exported one move at a time (nothing arrives at them
        during the wave; exports from one source run in submission order on its worker). Per wave: every export
        at once, then every import (targets take their packages in move order), then commit the exports whose
        import succeeded and cancel the others (two-phase per move: a failed import leaves that move's groups on
        its source). A failure is raised after the whole wave is settled; earlier waves stay applied."""
        out = {"groups": 0, "kv_bytes": 0}
        wave: list[tuple[int, int, int | None]] = []
        srcs: set[int] = set()
        dsts: set[int] = set()
        for m in moves:
            if m[0] in dsts or m[1] in srcs:
                self._migrate_wave(wave, out)
                wave, srcs, dsts = [], set(), set()
            wave.append(m)
            srcs.add(m[0])
            dsts.add(m[1])
        if wave:
            self._migrate_wave(wave, out)
        return out

    def _migrate_wave(self, wave: list[tuple[int, int, int | None]], out: dict) -> None:
        c, g, st = self.p.cluster, self.p.group, self.p.step_state
        t_idle = self.p.clock()
        self._idle({d for s, t, _ in wave for d in (s, t)})
        t0 = self.p.clock()
        # one call per device and phase: each source exports its moves' counts in wave order; each target, at
        # once, imports its packages in wave order straight from the exports' results in the object store (it
        # waits for them itself: one round trip for the driver, and the KV caches never pass through it); then
        # each source settles its exports (commit, or cancel where the import failed)
        by_src: dict[int, list[int]] = {}
        by_dst: dict[int, list[int]] = {}
        for k, (s, t, _) in enumerate(wave):
            by_src.setdefault(s, []).append(k)
            by_dst.setdefault(t, []).append(k)
        exports = {s: g.submit(s, f"{ROLES}:rollout_export_many", counts=[wave[k][2] for k in ks])
                   for s, ks in by_src.items()}
        where = {k: (exports[s].ref, i) for s, ks in by_src.items() for i, k in enumerate(ks)}
        hs = [g.submit(t, f"{ROLES}:rollout_import_from", sources=[where[k] for k in ks]) for t, ks in by_dst.items()]
        res: list[dict] = [{}] * len(wave)
        for ks, h in zip(by_dst.values(), hs):
            try:
                got = g.gather([h])[0]
            except Exception as err:   # the target's whole call failed: its moves stay on their sources
                got = [{"ok": False, "error": f"{type(err).__name__}: {err}"}] * len(ks)
            for k, r in zip(ks, got):
                res[k] = r
        failed = [(k, r["error"]) for k, r in enumerate(res) if not r["ok"]]
        # a source settles every move whose export it made; a move whose target failed as a whole has no receipt
        # from it: read the source's own export result (rare path: the driver fetches that package once)
        for k, r in enumerate(res):
            if "receipt" not in r and r.get("exported", True):
                try:
                    pkg = g.gather([exports[wave[k][0]]])[0][by_src[wave[k][0]].index(k)]
                    res[k] = {**r, "receipt": export_receipt(pkg)}
                except Exception:  # noqa: BLE001 - the export itself failed: nothing to settle
                    pass
        settles = [g.submit(s, f"{ROLES}:rollout_settle_exports", receipts=[res[k]["receipt"] for k in ks
                                                                             if "receipt" in res[k]],
                            commit=[res[k]["ok"] for k in ks if "receipt" in res[k]]) for s, ks in by_src.items()]
        if failed:
            g.gather(settles)   # a cancel must be done before the failure is reported and the run goes on
        else:   # commits are ordered before any later call on their sources; checked with the layout notes
            self._notes += settles
        t1 = self.p.clock()
        # where the wave went: draining its instances' slices, the slowest target's wait for (and fetch of) its
        # exports and its imports, the rest (calls' round trips)
        phases = {"drain": t0 - t_idle,
                  "fetch": max((r.get("fetch_s", 0.0) for r in res), default=0.0),
                  "import": max((r.get("import_s", 0.0) for r in res), default=0.0)}
        for k, ((src, dst, _), r) in enumerate(zip(wave, res)):
            if not r["ok"]:
                continue
            moved = r["queued"] + r["open"]
            st.given[src] = max(0, st.given.get(src, 0) - moved)
            st.given[dst] = st.given.get(dst, 0) + moved
            _move_reported(st.signals, src, dst, r)
            c.record("migration", step=st.step, src=src, dst=dst, groups=moved, requests=r["requests"],
                     kv_bytes=r["kv_bytes"], mode="kv", seconds=t1 - t0, wave=len(wave),
                     phases_s={name: round(sec, 4) for name, sec in phases.items()})
            out["groups"] += moved
            out["kv_bytes"] += r["kv_bytes"]
        c.timeline.add_busy(sorted({d for s, t, _ in wave for d in (s, t)}), "moving", "migrate", t0, t1)
        if failed:
            k, err = min(failed)
            raise RuntimeError(f"{len(failed)} of {len(wave)} moves failed (rolled back on their sources); first: "
                               f"{wave[k][0]} -> {wave[k][1]}: {err}")

    def release_rollout(self, instance_ids, migrate_to=(), back_to: Owner = Owner.FREE) -> dict:
        c, st = self.p.cluster, self.p.step_state
        targets = [t for t in migrate_to if t in c.rollout and t not in instance_ids] or \
            [t for t in c.rollout if t not in instance_ids]
        self._idle(instance_ids)
        moves = [(inst, targets[k % len(targets)], None) for k, inst in enumerate(instance_ids)
                 if st.given.get(inst, 0) and targets]
        if moves:
            self.migrate_many(moves)
        for inst in instance_ids:
            if st.given.get(inst, 0):
                raise RuntimeError(f"instance {inst} still holds {st.given[inst]} groups and no survivor can "
                                   "take them")
        g = self.p.group
        self.p.ledger.release(list(instance_ids), "rollout instance released")
        handles = [g.submit(inst, f"{ROLES}:rollout_release") for inst in instance_ids]   # all at once
        refused = None
        for inst, h in zip(instance_ids, handles):
            try:
                g.gather([h])
            except Exception as err:   # the instance still runs (it refused): it stays a rollout instance
                self.p.ledger.land([inst], Owner.ROLLOUT, "release refused: rolled back")
                refused = refused or err
                continue
            c.rollout.remove(inst)
            if back_to is Owner.FREE:
                self.p.ledger.free([inst], "rollout freed its memory")
            else:
                self.p.ledger.land([inst], back_to, "returned to the actor")
        if refused is not None:
            raise refused
        return {"devices": list(instance_ids)}

    def release_inference(self, devices) -> dict:
        c = self.p.cluster
        self._idle(devices)
        for d in devices:
            if d not in c.inference:
                raise ValueError(f"device {d} is not an inference device ({c.inference})")
        if len(devices) == len(c.inference) and (self.p.step_state.to_score or self.p.step_state.scoring):
            raise RuntimeError("inference still has groups to score; release it when done")
        self.p.ledger.release(devices, "inference released")
        g = self.p.group
        g.gather([g.submit(d, f"{ROLES}:inference_release") for d in devices])
        for d in devices:
            c.inference.remove(d)
        self.p.ledger.free(devices, "inference freed its memory")
        return {"devices": list(devices)}

    def _prepare(self, old: Layout, new: Layout, ranks) -> dict:
        """Every rank's reshard program, made here (`engine.reshard._commit.prepare_programs`, cached per pair
        shape): the driver's core is not capped, a 0.125-core CPU worker planned a new pair for 0.3-2.7 s (CPU e2e
        run) while the move itself took ~0.15 s. Empty when the actor's inputs are unknown: the ranks plan."""
        inputs = self.p.program_inputs
        if not inputs:
            return {}
        from tidal.engine.reshard._commit import prepare_programs
        return prepare_programs(old, new, inputs["specs"], ranks, inputs["param_bytes"], inputs["bucket_bytes"])

    def reshard(self, layout: Layout) -> dict:
        """Move the actor. The first time a move needs a process group that does not exist yet it is collective
        over the world (every worker idle first: group creation); later moves between known rank sets involve
        only the devices of either layout, and every other worker keeps generating or scoring meanwhile (it
        learns the new layout by a call queued behind its current one)."""
        c, g, ledger = self.p.cluster, self.p.group, self.p.ledger
        old = c.actor_layout
        if layout == old:
            return {}
        sets = reshard_rank_sets(old, layout)
        local = all(r in self._rank_sets for r in sets)
        members = sorted(set(old.devices) | set(layout.devices))
        t_idle = self.p.clock()
        self._idle(set(members) if local else set(g.device_ids))
        idle_s = self.p.clock() - t_idle
        joining = [d for d in layout.devices if d not in old.devices]
        leaving = [d for d in old.devices if d not in layout.devices]
        ledger.assign(joining, Owner.ACTOR, f"actor grows to {layout}")
        t0 = self.p.clock()
        try:
            ranks = members if local else list(g.device_ids)
            prepared = self._prepare(old, layout, ranks)
            prepare_s = self.p.clock() - t0
            handles = [g.submit(d, f"{ROLES}:actor_reshard", layout=layout, current=old, local=local,
                                prepared=prepared.get(d)) for d in ranks]
            reports = [r for r in g.gather(handles) if r is not None]
        except Exception:
            ledger.release(joining, "reshard failed: rolled back")
            ledger.free(joining, "reshard failed: rolled back")
            raise
        self._rank_sets.update(sets)
        if local:   # the others learn the layout in order, without waiting for them now
            others = [d for d in g.device_ids if d not in members]
            self._notes += g.submit_all(f"{ROLES}:actor_set_layout", device_ids=others, layout=layout)
        c.actor_layout = layout
        if leaving:
            ledger.release(leaving, f"actor shrinks to {layout}")
            ledger.free(leaving, "actor freed its shards")
        secs = self.p.clock() - t0
        moved = max(r["bytes_moved"] for r in reports)   # each rank reports the whole plan's bytes
        c.timeline.add_busy(sorted(set(old.devices) | set(layout.devices)), "moving", "reshard", t0, t0 + secs)
        # the workers' own reshard time excludes creating the layout's process groups (first use of a layout:
        # collective over the world, seconds on capped CPU workers); the rest of `secs` is that plus call overhead
        work = max(r["seconds"] for r in reports)
        call = max(r.get("call_s", 0.0) for r in reports)   # the workers' whole call (layout sync, rebind)
        gc_s = max(r.get("gc_s", 0.0) for r in reports)
        phases = {k[len("phase_"):-2]: round(max(r.get(k, 0.0) for r in reports), 4)
                  for k in sorted({k for r in reports for k in r if k.startswith("phase_")})}
        c.record("reshard", step=self.p.step_state.step, iter=self.p.step_state.iters_done, from_layout=str(old),
                 to_layout=str(layout), bytes_moved=moved, seconds=secs, worker_s=work, phases_s=phases,
                 prepared=all(r.get("prepared") for r in reports), idle_s=idle_s, prepare_s=prepare_s,
                 call_s=call, gc_s=gc_s,
                 devices=list(layout.devices), scope="members" if local else "world")
        return {"bytes_moved": moved}

    def lend(self, devices, lent: bool = True) -> dict:
        """Actor devices host rollout instances for a while (the actor cannot train until they return); with
        `lent=False` (StartRollout) FREE devices become ordinary instances."""
        c, p = self.p.cluster, self.p
        self._idle(devices)
        if lent:
            p.ledger.release(devices, "lent to rollout")
            p.ledger.land(devices, Owner.ROLLOUT, "lent to rollout")
        else:
            p.ledger.assign(devices, Owner.ROLLOUT, "rollout instance started")
        p.group.gather([p.group.submit(d, f"{ROLES}:rollout_start", instance_id=str(d), weights=p.weights_for(d),
                                       version=p.version, step=p.step_state.step) for d in devices])
        for d in devices:
            c.rollout.append(d)
            if lent:
                c.lent.add(d)
        return {"devices": list(devices)}

    def lend_inference(self, devices) -> dict:
        """Idle inference devices host rollout instances (groups wait for scoring until they return)."""
        c, p = self.p.cluster, self.p
        self._idle(devices)
        p.ledger.release(devices, "inference lent to rollout")
        p.ledger.land(devices, Owner.ROLLOUT, "inference lent to rollout")
        p.group.gather([p.group.submit(d, f"{ROLES}:rollout_start", instance_id=str(d), weights=p.weights_for(d),
                                       version=p.version, step=p.step_state.step) for d in devices])
        for d in devices:
            c.inference.remove(d)
            c.rollout.append(d)
            self.inf_lent.append(d)
        return {"devices": list(devices)}

    def return_inference(self, instance_ids) -> dict:
        """Lent inference devices score again (their work was migrated away first; their model is kept)."""
        c = self.p.cluster
        self.release_rollout(list(instance_ids), back_to=Owner.INFERENCE)
        for d in instance_ids:
            self.inf_lent.remove(d)
            c.inference.append(d)
        c.inference.sort()
        return {"devices": list(instance_ids)}

    # ---- what the producer learns -------------------------------------------------------------------------
    def learn(self) -> None:
        """After a step: fit the length model on its responses and the readiness curve on its generation times
        (the fraction of rollout time by which k/16 of the groups were generated), as the simulator does."""
        p, st = self.p, self.p.step_state
        lengths = [len(r) for sg in st.scored.values() for r in sg.response_ids]
        if not lengths:
            return
        self.lengths = LengthModel.fit(lengths, p.cfg.rollout.max_new_tokens)
        prompts = [len(sg.prompt_ids) for sg in st.scored.values()]
        # when the id-order prefix reached k groups (what the actor waits for), not when k groups were generated
        t = np.maximum.accumulate(np.asarray([st.gen_time[i] for i in sorted(st.gen_time)])) - self._t_start
        span = float(t.max()) if t.size and t.max() > 0 else 1.0
        curve = tuple((np.quantile(t, np.linspace(0, 1, 17)) / span).tolist()) if t.size else ()
        costs = p.sched_state.costs
        dec = learn_decode(st.decode_samples, costs.decode)
        if dec is not None:   # the decode step time this run measured (the preset's is a prior)
            costs = costs.with_decode(dec)
        sc = learn_scoring(st.score_samples, costs.inference, p.cfg.inference.tensor_parallel_size)
        if sc is not None:    # and what scoring a group costs as the driver sees it
            costs = replace(costs, inference=sc)
        # priced with the decode cost just learned, so the factor corrects only what the model misses (sequences
        # start in waves, stragglers), not the step time twice
        plain = replace(p.sched_state, costs=costs, rollout_time_factor=1.0)
        notes = [(t, float(plain.decode_seconds(rem / n, tail))) for t, rem, tail, n in self._predictions]
        factor = learn_rollout_factor(notes, max(st.gen_time.values(), default=0.0))
        self._predictions = []
        if factor is None:
            factor = p.sched_state.rollout_time_factor
        actor_factor = learn_actor_factor(st.iter_samples, costs.actor,
                                          micro_batches=p.sched_state.params.micro_batches)
        if actor_factor is None:
            actor_factor = p.sched_state.actor_time_factor
        step_events = [e for e in p.cluster.events if e.get("step") == st.step]
        res = learn_reshard(step_events, costs.reshard)
        if res is not None:   # and what its reshards really cost, all in
            costs = replace(costs, reshard=res)
        moves = learn_moves(step_events, costs, p.sched_state.params.kv_migration)
        if moves is not None:  # and its migrations, lends and returns
            costs = moves
        p.cluster.record("learn", step=st.step, decode_step_s=costs.decode.step_s, reshard_fixed_s=costs.reshard.fixed_s,
                         kv_fixed_s=costs.kv_fixed_s, migration_fixed_s=costs.migration_fixed_s,
                         lend_s=costs.lend_s, return_s=costs.return_s,
                         score_group_s=costs.inference.per_group_s, score_samples=len(st.score_samples),
                         iter_samples=[list(x) for x in st.iter_samples], rollout_time_factor=factor,
                         actor_time_factor=actor_factor,
                         decode_samples=len(st.decode_samples), mean_response_tokens=self.lengths.mean)
        p.sched_state = replace(p.sched_state, mean_response_tokens=self.lengths.mean,
                                prompt_tokens=float(np.mean(prompts)), ready_curve=curve, costs=costs,
                                rollout_time_factor=factor, actor_time_factor=actor_factor)

    # ---- end of step ---------------------------------------------------------------------------------------
    def return_lent(self, why: str) -> None:
        """Every instance on lent actor devices goes back to the actor (their work, if any, migrates first)."""
        c = self.p.cluster
        if c.lent:
            lent = sorted(c.lent)
            self.release_rollout(lent, back_to=Owner.ACTOR)
            c.lent.clear()
            c.record("return_lent", step=self.p.step_state.step, devices=lent, reason=why)

    def restore(self) -> None:
        """Back to the initial placement for the next step's rollout (RLinf does the same)."""
        p, c = self.p, self.p.cluster
        self.return_lent("step end")
        if self.inf_lent:
            self.return_inference(list(self.inf_lent))
        if c.actor_layout != p.initial_layout:
            self.reshard(p.initial_layout)
        pl = p.cfg.placement
        back_r = [d for d in pl.rollout if d not in c.rollout]
        back_i = [d for d in pl.inference if d not in c.inference]
        if back_r:
            p.ledger.assign(back_r, Owner.ROLLOUT, "step end: rollout placement restored")
            c.rollout = sorted(c.rollout + back_r)
        if back_i:
            p.ledger.assign(back_i, Owner.INFERENCE, "step end: inference placement restored")
            c.inference = sorted(c.inference + back_i)
        if back_r or back_i:
            c.record("restore", step=p.step_state.step, rollout=back_r, inference=back_i)
