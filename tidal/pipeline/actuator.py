"""The actuator of real runs (`scheduler.reconcile.Actuator` on Ray device workers): each action becomes calls
on the workers, ledger transitions and one event.

Ownership rules (tidal.core.devices): a device leaves its role as MOVING and becomes FREE only after its old role
freed it; a device joins a role only from FREE. A failed action leaves the cluster as it was before it
(migration is two-phase, resharding rolls back inside the engine) and its ledger moves are undone.

State owned here: the placement (`tidal.pipeline.placement.LivePlacement`: which devices host which component,
what is lent, the homes each step starts on), handed out as a frozen snapshot and replaced only by this class's
methods; the process groups every worker has made (`rank_sets`); and the calls not waited for (`notes`: layout
notes to workers outside a member-local reshard, a migration wave's commits), checked at the step end. The
step's work bookkeeping (`StepState.given`, the instances' last reports) is the driver's; a migration carries it
along.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, cast

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
from tidal.core.devices import Owner
from tidal.engine.backends.protocol import ProgramInputs
from tidal.engine.groups import layout_rank_sets, reshard_rank_sets
from tidal.engine.layout import Layout
from tidal.engine.reshard.commit import prepare_programs
from tidal.pipeline.cluster import Cluster, StepState
from tidal.pipeline.placement import Homes, LivePlacement
from tidal.workers.messages import KVRoute, MoveResult, PackageRef, ReshardReport
from tidal.workers.roles import EngineWeights
from tidal.workers.runtime import CallHandle

Move = tuple[int, int, int | None]   # (source instance, target instance, groups: None = all)


def migration_waves(moves: list[Move]) -> list[list[Move]]:
    """`moves` cut, in order, into waves in which no device is both a source and a target: a wave's sources
    then export exactly what they would have exported one move at a time."""
    waves: list[list[Move]] = []
    wave: list[Move] = []
    srcs: set[int] = set()
    dsts: set[int] = set()
    for m in moves:
        if m[0] in dsts or m[1] in srcs:
            waves.append(wave)
            wave, srcs, dsts = [], set(), set()
        wave.append(m)
        srcs.add(m[0])
        dsts.add(m[1])
    if wave:
        waves.append(wave)
    return waves


class RayActuator:
    """Applies actions to the workers of `cluster` and owns the placement (module doc). `drain(devices)` waits
    for the calls in flight on `devices` and hands their results to the driver; `engine_load(device)` is what
    an engine started there mid-step loads (its weights and their version), `peer_sends(loads)` the calls that
    send those weights point to point from a peer's kept copy.
    Reshard programs are planned here rather than on (capped) workers once `plan_reshards_with` gave the actor's
    inputs."""

    def __init__(self, cluster: Cluster, drain: Callable[[set[int]], None],
                 engine_load: Callable[[int], tuple[EngineWeights, int]], homes: Homes,
                 peer_sends: Callable[[Sequence[tuple[int, EngineWeights]]], list[CallHandle[int]]]):
        self.c, self.group, self.ledger, self.calls = cluster, cluster.group, cluster.ledger, cluster.endpoints
        self.drain, self.engine_load, self.peer_sends = drain, engine_load, peer_sends
        self.program_inputs: ProgramInputs | None = None
        self._placement = LivePlacement.at_home(homes)
        # rank sets whose process groups every worker has made (mirrors engine.groups.GroupCache)
        self.rank_sets: set[tuple[int, ...]] = {tuple(sorted(r)) for r in layout_rank_sets(homes.actor)
                                                if len(r) >= 2}
        self.notes: list[Any] = []
        self.st: StepState | None = None

    @property
    def placement(self) -> LivePlacement:
        """Where each component is now (a frozen snapshot: the next change makes a new one)."""
        return self._placement

    def _place(self, **changes: Any) -> None:
        """The one writer of the placement."""
        self._placement = replace(self._placement, **changes)

    def plan_reshards_with(self, inputs: ProgramInputs | None) -> None:
        """The actor's specs etc., to plan reshard programs here (None: the actor's backend plans them)."""
        self.program_inputs = inputs

    def begin_step(self, st: StepState) -> None:
        self.st = st

    @property
    def _st(self) -> StepState:
        """The step in progress: actions are applied only after its `begin_step`."""
        return cast(StepState, self.st)

    def known_rank_sets(self, sets: Iterable[Iterable[int]]) -> None:
        """Rank sets whose groups every worker has made (outside a reshard, e.g. at start)."""
        self.rank_sets.update(ranks for r in sets if len(ranks := tuple(sorted(r))) >= 2)

    def settle_notes(self) -> None:
        """Every call not waited for has run: a failed note or commit is a bug, raised here, not later."""
        self.group.gather(self.notes)
        self.notes = []

    # ---- the actions ------------------------------------------------------------------------------------------
    def wait(self, a: Wait) -> None:
        pass   # the driver asks again at its next boundary pass

    def migrate_requests(self, a: MigrateRequests) -> dict[str, Any]:
        return self.migrate([(a.src, a.dst, a.count)])

    def migrate_batch(self, a: MigrateBatch) -> dict[str, Any]:
        return self.migrate(list(a.moves))

    def release_rollout(self, a: ReleaseRollout) -> dict[str, Any]:
        return self.finish_instances(a.instance_ids, a.migrate_to)

    def return_from_rollout(self, a: ReturnFromRollout) -> dict[str, Any]:
        out = self.finish_instances(a.instance_ids, a.migrate_to, back_to=Owner.ACTOR)
        self._place(lent=self._placement.lent - set(a.instance_ids))
        return out

    def release_inference(self, a: ReleaseInference) -> dict[str, Any]:
        st, devices, inference = self._st, list(a.devices), self._placement.inference
        self.drain(set(devices))
        for d in devices:
            if d not in inference:
                raise ValueError(f"device {d} is not an inference device ({list(inference)})")
        if len(devices) == len(inference) and (st.to_score or st.scoring):
            raise RuntimeError("inference still has groups to score; release it when done")
        self.ledger.release(devices, "inference released")
        self.group.gather([self.calls.inference.release(d) for d in devices])
        self._place(inference=_without(self._placement.inference, devices))
        self.ledger.free(devices, "inference freed its memory")
        return {"devices": devices}

    def reshard_actor(self, a: ReshardActor) -> dict[str, Any]:
        t = a.to_layout
        return self.reshard(Layout(t.tp, t.dp, tuple(t.devices)))

    def lend_to_rollout(self, a: LendToRollout) -> dict[str, Any]:
        return self.start_instances(a.devices, lent=True)

    def start_rollout(self, a: StartRollout) -> dict[str, Any]:
        return self.start_instances(a.devices, lent=False)

    def lend_inference(self, a: LendInference) -> dict[str, Any]:
        """Idle inference devices host rollout instances (groups wait for scoring until they return)."""
        devices, p = list(a.devices), self._placement
        self.drain(set(devices))
        self.ledger.release(devices, "inference lent to rollout")
        self.ledger.land(devices, Owner.ROLLOUT, "inference lent to rollout")
        self._start_engines(devices)
        self._place(inference=_without(p.inference, devices), rollout=(*p.rollout, *devices),
                    inference_lent=(*p.inference_lent, *devices))
        return {"devices": devices}

    def return_to_inference(self, a: ReturnToInference) -> dict[str, Any]:
        return self.return_inference(list(a.instance_ids))

    # ---- mechanisms ---------------------------------------------------------------------------------------------
    def migrate(self, moves: list[Move]) -> dict[str, Any]:
        """Apply `moves` with the result of applying them one by one, in waves of concurrent calls (see
        `migration_waves`). Per wave: every export at once, then every import (targets take their packages in
        move order), then commit the exports whose import succeeded and cancel the others (two-phase per move: a
        failed import leaves that move's groups on its source). A failure is raised after the whole wave is
        settled; earlier waves stay applied."""
        out: dict[str, Any] = {"groups": 0, "kv_bytes": 0}
        for wave in migration_waves(moves):
            self._migrate_wave(wave, out)
        return out

    def _exchange(self, wave: list[Move]) -> tuple[list[MoveResult], dict[int, list[int]], list[KVRoute]]:
        """One call per device and phase: each source exports its moves' counts in wave order (small packages;
        the KV stays in its blocks) and streams the KV of its point-to-point moves; each target, at once, imports
        its packages in wave order, taking the KV by each move's route (`WorkerGroup.transfer_route`; the transfer
        layer, never the object store or the driver). Every device runs its transfers in wave order, so no two
        wait on each other. Returns each move's result, the moves per source and each move's route."""
        g = self.group
        by_src: dict[int, list[int]] = {}
        by_dst: dict[int, list[int]] = {}
        for k, (s, t, _) in enumerate(wave):
            by_src.setdefault(s, []).append(k)
            by_dst.setdefault(t, []).append(k)
        routes = [g.transfer_route(s, t) for s, t, _ in wave]
        rollout = self.calls.rollout
        exports = {s: rollout.export_many(s, [wave[k][2] for k in ks], [routes[k] for k in ks])
                   for s, ks in by_src.items()}
        sends = [rollout.send_kv(s, p2p) for s, ks in by_src.items()
                 if (p2p := [(i, wave[k][1]) for i, k in enumerate(ks) if routes[k] == "p2p"])]
        where = {k: PackageRef(exports[s].ref, i, s, routes[k]) for s, ks in by_src.items() for i, k in enumerate(ks)}
        hs = [rollout.import_from(t, [where[k] for k in ks]) for t, ks in by_dst.items()]
        res: list[MoveResult] = [MoveResult(False)] * len(wave)
        for ks, h in zip(by_dst.values(), hs):
            try:
                got = g.gather([h])[0]
            except Exception as err:   # the target's whole call failed: its moves stay on their sources
                got = [MoveResult(False, error=f"{type(err).__name__}: {err}")] * len(ks)
            for k, r in zip(ks, got):
                res[k] = r
        for sent in sends:   # a failed stream failed its moves on the targets (reported there)
            try:
                g.gather([sent])
            except Exception:  # noqa: BLE001 - the target's result holds the move's error
                pass
        # a move whose target failed as a whole has no receipt from it: read the source's own export result
        for k, r in enumerate(res):
            if r.receipt is None and r.exported:
                try:
                    pkg = g.gather([exports[wave[k][0]]])[0][by_src[wave[k][0]].index(k)]
                    res[k] = replace(r, receipt=pkg.receipt())
                except Exception:  # noqa: BLE001 - the export itself failed: nothing to settle
                    pass
        return res, by_src, routes

    def _migrate_wave(self, wave: list[Move], out: dict[str, Any]) -> None:
        c, st = self.c, self._st
        t_idle = c.clock()
        self.drain({d for s, t, _ in wave for d in (s, t)})
        t0 = c.clock()
        res, by_src, routes = self._exchange(wave)
        failed = [(k, r.error) for k, r in enumerate(res) if not r.ok]
        # each source settles its exports: commit, or cancel where the import failed
        settles = [self.calls.rollout.settle_exports(s, [rec for k in ks if (rec := res[k].receipt) is not None],
                                                     [res[k].ok for k in ks if res[k].receipt is not None])
                   for s, ks in by_src.items()]
        if failed:
            self.group.gather(settles)   # a cancel must be done before the failure is reported
        else:   # commits are ordered before any later call on their sources; checked with the layout notes
            self.notes += settles
        t1 = c.clock()
        # where the wave went: draining its instances' slices, the slowest target's wait for (and fetch of) its
        # exports and its imports, the rest (calls' round trips)
        phases = {"drain": t0 - t_idle, "fetch": max((r.fetch_s for r in res), default=0.0),
                  "import": max((r.import_s for r in res), default=0.0)}
        first = True   # the wave's first recorded move carries its seconds for the tables (`wave_first`)
        for (src, dst, _), r, route in zip(wave, res, routes):
            if not r.ok or r.summary is None:
                continue
            m = r.summary
            st.moved(src, dst, m)
            c.record("migration", step=st.step, src=src, dst=dst, groups=m.groups, requests=m.requests,
                     kv_bytes=m.kv_bytes, mode="reprefill" if route == "reprefill" else "kv", route=route,
                     seconds=t1 - t0, wave=len(wave), wave_first=first,
                     phases_s={name: round(sec, 4) for name, sec in phases.items()})
            first = False
            out["groups"] += m.groups
            out["kv_bytes"] += m.kv_bytes
        c.timeline.add_busy(sorted({d for s, t, _ in wave for d in (s, t)}), "moving", "migrate", t0, t1)
        if failed:
            k, err = min(failed)
            raise RuntimeError(f"{len(failed)} of {len(wave)} moves failed (rolled back on their sources); first: "
                               f"{wave[k][0]} -> {wave[k][1]}: {err}")

    def finish_instances(self, instance_ids: Iterable[int], migrate_to: Iterable[int] = (),
                         back_to: Owner = Owner.FREE) -> dict[str, Any]:
        """Stop rollout instances `instance_ids` (their work migrates to `migrate_to`, or to any other instance);
        their devices go to `back_to` (FREE, or straight back to the actor / inference)."""
        st, ids, rollout = self._st, list(instance_ids), self._placement.rollout
        targets = [t for t in migrate_to if t in rollout and t not in ids] or [t for t in rollout if t not in ids]
        self.drain(set(ids))
        moves: list[Move] = [(inst, targets[k % len(targets)], None) for k, inst in enumerate(ids)
                             if st.given.get(inst, 0) and targets]
        if moves:
            self.migrate(moves)
        for inst in ids:
            if st.given.get(inst, 0):
                raise RuntimeError(f"instance {inst} still holds {st.given[inst]} groups and no survivor can "
                                   "take them")
        self.ledger.release(ids, "rollout instance released")
        handles = [self.calls.rollout.release(inst) for inst in ids]   # all at once
        refused = None
        for inst, h in zip(ids, handles):
            try:
                self.group.gather([h])
            except Exception as err:   # the instance still runs (it refused): it stays a rollout instance
                self.ledger.land([inst], Owner.ROLLOUT, "release refused: rolled back")
                refused = refused or err
                continue
            self._place(rollout=_without(self._placement.rollout, [inst]))
            if back_to is Owner.FREE:
                self.ledger.free([inst], "rollout freed its memory")
            else:
                self.ledger.land([inst], back_to, "returned to the actor")
        if refused is not None:
            raise refused
        return {"devices": ids}

    def _start_engines(self, devices: list[int]) -> None:
        """Rollout engines on `devices`, each loading what `engine_load` names; the devices whose weights come
        point to point from a peer's kept copy receive them while that peer sends (`peer_sends`)."""
        start = self.calls.rollout.start
        loads = {d: self.engine_load(d) for d in devices}
        hs: list[CallHandle[Any]] = [start(d, w, v, step=self._st.step) for d, (w, v) in loads.items()]
        self.group.gather(hs + self.peer_sends([(d, w) for d, (w, _) in loads.items()]))

    def start_instances(self, devices: Iterable[int], lent: bool) -> dict[str, Any]:
        """Rollout instances on `devices`: the actor's, lent for a while (the actor cannot train until they
        return), or FREE devices as ordinary instances (`lent=False`)."""
        devices = list(devices)
        self.drain(set(devices))
        if lent:
            self.ledger.release(devices, "lent to rollout")
            self.ledger.land(devices, Owner.ROLLOUT, "lent to rollout")
        else:
            self.ledger.assign(devices, Owner.ROLLOUT, "rollout instance started")
        self._start_engines(devices)
        p = self._placement
        self._place(rollout=(*p.rollout, *devices), lent=p.lent | set(devices) if lent else p.lent)
        return {"devices": devices}

    def return_inference(self, instance_ids: list[int]) -> dict[str, Any]:
        """Lent inference devices score again (their work was migrated away first; their model is kept)."""
        self.finish_instances(instance_ids, back_to=Owner.INFERENCE)
        p = self._placement
        self._place(inference_lent=_without(p.inference_lent, instance_ids),
                    inference=tuple(sorted((*p.inference, *instance_ids))))
        return {"devices": list(instance_ids)}

    def _prepare(self, old: Layout, new: Layout, ranks: list[int]) -> dict[int, Any]:
        """Every rank's reshard program, made here (`engine.reshard.commit.prepare_programs`, cached per pair
        shape): the driver's core is not capped, while a capped CPU worker plans a new pair in seconds. Empty
        when the actor gives no inputs (a backend that plans its own moves): the ranks plan."""
        inputs = self.program_inputs
        if inputs is None:
            return {}
        return prepare_programs(old, new, inputs.specs, ranks, inputs.param_bytes, inputs.bucket_bytes)

    def reshard(self, layout: Layout) -> dict[str, Any]:
        """Move the actor. The first time a move needs a process group that does not exist yet it is collective
        over the world (every worker idle first: group creation); later moves between known rank sets involve
        only the devices of either layout, and every other worker keeps generating or scoring meanwhile (it
        learns the new layout by a call queued behind its current one)."""
        c, g, ledger = self.c, self.group, self.ledger
        old = self._placement.actor
        if layout == old:
            return {}
        outside = sorted(set(layout.devices) - set(g.world_ids))
        if outside:   # a replacement worker (tidal.pipeline.rejoin) or a dead one holds no rank of the world
            raise RuntimeError(f"reshard to {layout}: devices {outside} are not ranks of the world (replaced or "
                               "dead); the actor grows onto world ranks only")
        sets = reshard_rank_sets(old, layout)
        local = all(r in self.rank_sets for r in sets)
        members = sorted(set(old.devices) | set(layout.devices))
        t_idle = c.clock()
        self.drain(set(members) if local else set(g.world_ids))
        idle_s = c.clock() - t_idle
        joining = [d for d in layout.devices if d not in old.devices]
        leaving = [d for d in old.devices if d not in layout.devices]
        ledger.assign(joining, Owner.ACTOR, f"actor grows to {layout}")
        t0 = c.clock()
        try:
            ranks = members if local else list(g.world_ids)
            prepared = self._prepare(old, layout, ranks)
            prepare_s = c.clock() - t0
            handles = [self.calls.actor.reshard(d, layout, old, local, prepared.get(d)) for d in ranks]
            reports: list[ReshardReport] = [r for r in g.gather(handles) if r is not None]
        except Exception:
            ledger.release(joining, "reshard failed: rolled back")
            ledger.free(joining, "reshard failed: rolled back")
            raise
        self.rank_sets.update(sets)
        if local:   # the others learn the layout in order, without waiting for them now
            others = [d for d in g.world_ids if d not in members]
            self.notes += self.calls.actor.set_layout(others, layout)
        self._place(actor=layout)
        if leaving:
            ledger.release(leaving, f"actor shrinks to {layout}")
            ledger.free(leaving, "actor freed its shards")
        secs = c.clock() - t0
        c.timeline.add_busy(members, "moving", "reshard", t0, t0 + secs)
        self._record_reshard(old, layout, reports, secs, idle_s=idle_s, prepare_s=prepare_s, local=local)
        return {"bytes_moved": max(r.bytes_moved for r in reports)}

    def _record_reshard(self, old: Layout, new: Layout, reports: list[ReshardReport], secs: float, *,
                        idle_s: float, prepare_s: float, local: bool) -> None:
        """One event per reshard. The workers' own time excludes creating the layout's process groups (first use
        of a layout: collective over the world); the rest of `secs` is that plus call overhead. Each rank
        reports the whole plan's bytes."""
        phases = {k: round(max(r.phase_s.get(k, 0.0) for r in reports), 4)
                  for k in sorted({k for r in reports for k in r.phase_s})}
        self.c.record("reshard", step=self._st.step, iter=self._st.iters_done, from_layout=str(old),
                      to_layout=str(new), bytes_moved=max(r.bytes_moved for r in reports), seconds=secs,
                      worker_s=max(r.seconds for r in reports), phases_s=phases,
                      prepared=all(r.prepared for r in reports), idle_s=idle_s, prepare_s=prepare_s,
                      call_s=max(r.call_s for r in reports), gc_s=max(r.gc_s for r in reports),
                      devices=list(new.devices), scope="members" if local else "world")

    # ---- end of step ---------------------------------------------------------------------------------------
    def return_lent(self, why: str) -> None:
        """Every instance on lent actor devices goes back to the actor (their work, if any, migrates first)."""
        if self._placement.lent:
            lent = sorted(self._placement.lent)
            self.finish_instances(lent, back_to=Owner.ACTOR)
            self._place(lent=frozenset())
            self.c.record("return_lent", step=self._st.step, devices=lent, reason=why)

    def restore(self) -> None:
        """Back to the homes for the next step's rollout (RLinf does the same)."""
        ledger, homes = self.ledger, self._placement.homes
        self.return_lent("step end")
        if self._placement.inference_lent:
            self.return_inference(list(self._placement.inference_lent))
        # instances started mid-step (StartRollout): their devices go FREE, the actor or a home takes them
        started = [d for d in self._placement.rollout if d not in homes.rollout]
        if started:
            self.finish_instances(started)
        if self._placement.actor != homes.actor:
            self.reshard(homes.actor)
        failed = set(ledger.owned(Owner.FAILED))   # lost devices stay out (`tidal.pipeline.faults`)
        p = self._placement
        back_r = [d for d in homes.rollout if d not in p.rollout and d not in failed]
        back_i = [d for d in homes.inference if d not in p.inference and d not in failed]
        ledger.assign_many({Owner.ROLLOUT: back_r, Owner.INFERENCE: back_i}, "step end: placement restored")
        self._place(rollout=tuple(sorted((*p.rollout, *back_r))), inference=tuple(sorted((*p.inference, *back_i))))
        if back_r or back_i:
            self.c.record("restore", step=self._st.step, rollout=back_r, inference=back_i)

    # ---- losses ----------------------------------------------------------------------------------------------
    def lose(self, device: int) -> None:
        """A rollout or inference device lost mid-step leaves its component (`tidal.pipeline.faults`: the ledger
        already says FAILED, its work goes to the survivors)."""
        p = self._placement
        self._place(rollout=_without(p.rollout, [device]), inference=_without(p.inference, [device]))

    def abandon_step(self) -> None:
        """The step in progress is abandoned (`tidal.pipeline.survivors`: every worker's calls ended, every engine
        dropped): the calls not waited for are not wanted, and nothing is lent any more."""
        self.notes = []
        self._place(lent=frozenset(), inference_lent=())

    def continue_on(self, homes: Homes, why: str) -> None:
        """The placement after a loss beyond a step: every live device out of its role, then each to its new
        home; later steps start there and their ends restore it."""
        live = [d for d in self.group.live_ids if self.ledger.owner(d) not in (Owner.FREE, Owner.FAILED)]
        self.ledger.free(live, "step abandoned: a device was lost")
        self.ledger.assign_many({Owner.ACTOR: homes.actor.devices, Owner.ROLLOUT: homes.rollout,
                                 Owner.INFERENCE: homes.inference}, why)
        self._placement = LivePlacement.at_home(homes)


def _without(devices: tuple[int, ...], gone: Iterable[int]) -> tuple[int, ...]:
    drop = set(gone)
    return tuple(d for d in devices if d not in drop)
