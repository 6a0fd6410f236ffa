"""The policy versions the engines run: which weights each rollout and inference engine loads, when, and from
where. One owner (`Generations`) of the version, the devices' kept copies and the reference an engine started
mid-step loads; the driver (`tidal.pipeline.driver.Pipeline`) calls it at a run's start, a step's end and a resume.

    step end ── keep_at_step_end(): each actor rank keeps a whole replica of version v+1 (calls not waited for)
    sync(step) ── version + 1; engines whose device kept a copy load it in place; the others receive a broadcast
                  from the actor's first device, or the gathered weights through the object store
    load(weights, step) ── every engine of the placement on the current version (hand-over first on shared devices)
    weights_for(device) ── what an engine started mid-step (a lend, `StartRollout`) loads
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tidal.core.config import TidalConfig
from tidal.engine.generation.weights import rollout_shard
from tidal.engine.transfer import CudaIpcTensor
from tidal.pipeline.actuator import RayActuator
from tidal.pipeline.cluster import Cluster
from tidal.pipeline.placement import LivePlacement
from tidal.pipeline.sharing import Sharing
from tidal.workers.messages import BroadcastWeights, HandoverReport, KeptWeights, PeerWeights, RolloutModel
from tidal.workers.roles import EngineWeights, RunSpec
from tidal.workers.runtime import CallHandle


class Generations:
    """The engines' weights across versions (module doc)."""

    def __init__(self, cfg: TidalConfig, spec: RunSpec, cluster: Cluster, actuator: RayActuator, sharing: Sharing,
                 clock: Callable[[], float]):
        self.cfg, self.spec, self.cluster, self.actuator, self.sharing, self.clock = \
            cfg, spec, cluster, actuator, sharing, clock
        self.group, self.calls = cluster.group, cluster.endpoints
        self.version = 0
        #: devices whose worker kept a copy of the current version's weights (`sync`), and the step-end calls that
        #: keep the next ones
        self.kept: frozenset[int] = frozenset()
        self._keeping: list[tuple[int, CallHandle[bool]]] = []
        #: what an engine started mid-step loads when neither its device nor a peer can give it a copy
        #: (`weights_for`: a replacement worker)
        self.weights_ref: EngineWeights | None = None
        #: the CUDA IPC handles of the kept copy engines on its GPU map, per version (`weights_for`)
        self._shared: tuple[int, tuple[CudaIpcTensor, ...]] | None = None

    @property
    def placement(self) -> LivePlacement:
        return self.actuator.placement

    @property
    def unsynced(self) -> bool:
        """The step's end kept weights for a version no engine loaded yet (`sync` is due)."""
        return bool(self._keeping)

    def resumed(self, version: int, step: int) -> None:
        """The actor loaded a checkpoint of `version`: every engine loads its weights, gathered from the actor."""
        self.version = version
        self.load(self.group.put(self.global_weights()), step)

    def load(self, weights_ref: EngineWeights | None, step: int) -> None:
        """Rollout and inference engines of `self.version`: from the worker's kept copy where it has one, else
        from `weights_ref` (None only when every engine's device kept a copy). On devices the actor shares with
        rollout the actor first hands the device over (`actor.offload_*`), so the engines find the memory free;
        where rollout and inference share a device inference scores with the rollout engine's model."""
        g, share = self.group, self.sharing
        self.weights_ref = weights_ref  # kept: instances started mid-step (lend, StartRollout) load these weights

        def w(d: int) -> EngineWeights:
            if d in self.kept:
                return KeptWeights(self.version)
            assert weights_ref is not None, f"device {d} kept no copy of version {self.version} and none was sent"
            return weights_ref

        calls, p = self.calls, self.placement
        hs: list[CallHandle[object]] = []
        if isinstance(weights_ref, BroadcastWeights):   # before any hand-over offloads the actor's weights
            self.weights_ref = None
            lay = p.actor   # at TP > 1 the layout gathers a replica first (collective over it)
            hs += calls.actor.broadcast_weights([weights_ref.src] if lay.tp == 1 else list(lay.devices), weights_ref)
        hand = self._to_generation()
        hs += [calls.rollout.start(d, w(d), self.version, step) for d in p.rollout]
        hs += [calls.inference.load(d, RolloutModel(self.version) if share.rollout_inference and d in p.rollout
                                    else w(d), self.version) for d in p.inference]
        if share.any and not self.cfg.cluster.auto_scheduler and self.kept:   # no engine starts mid-step
            hs += calls.actor.drop_kept(sorted(self.kept))
        g.gather(hs)
        self.record_handover("to_generation", hand, step)

    def shared_actor_devices(self) -> list[int]:
        """Actor devices that also generate (their hand-overs run each step)."""
        return sorted(set(self.placement.homes.actor.devices) & set(self.placement.rollout)) \
            if self.sharing.actor_rollout else []

    def _to_generation(self) -> list[tuple[int, CallHandle[HandoverReport]]]:
        """The actor's devices that generate next: its state to host memory as `actor.offload_*` say (calls
        queued before the engines' loads, not waited for here)."""
        devices = self.shared_actor_devices()
        if not devices:
            return []
        off = self.sharing.offloads
        return [(d, self.calls.actor.offload(d, **off)) for d in devices]

    def record_handover(self, direction: str, calls: list[tuple[int, CallHandle[HandoverReport]]],
                         step: int) -> None:
        """One `handover` event per hand-over: bytes and seconds (slowest device), the actor's bytes left on its
        devices, and on CUDA the phase's peak device memory that it ends."""
        if not calls:
            return
        report = HandoverReport.slowest(self.group.gather([h for _, h in calls]))
        self.cluster.record("handover", step=step, direction=direction, devices=[d for d, _ in calls],
                            offload=self.sharing.offloads, **report.measured())

    def weights_for(self, device: int) -> EngineWeights:
        """What an engine started on `device` mid-step (a lend, `StartRollout`) loads: the copy its worker kept,
        or another device's kept copy by the transfer layer (`PeerWeights`: point to point, the sender's call
        submitted beside the load by `peer_sends`, or mapped by CUDA IPC on one GPU). A replacement worker, in
        no world, takes the weights through the object store, fetched once from a device that kept them."""
        if device in self.kept:
            return KeptWeights(self.version)
        if self.weights_ref is None and self.kept:
            src = min(self.kept)
            route = self.group.transfer_route(src, device)
            if route == "p2p":
                return PeerWeights(self.version, src, route)
            if route == "ipc":
                if self._shared is None or self._shared[0] != self.version:
                    handles = self.group.gather([self.calls.actor.share_kept(src, self.version)])[0]
                    self._shared = (self.version, handles)
                return PeerWeights(self.version, src, route, self._shared[1])
        if self.weights_ref is None:   # every engine loaded a kept copy: `kept` is not empty
            kept = self.group.gather([self.calls.actor.kept_weights(min(self.kept), self.version)])[0]
            self.weights_ref = self.group.put(kept)
        return self.weights_ref

    def peer_sends(self, loads: Sequence[tuple[int, EngineWeights]]) -> list[CallHandle[int]]:
        """The sender's calls for the engines among `loads` that take a kept copy point to point: one call per
        source, its targets in the order given (the order their loads were submitted)."""
        by_src: dict[int, list[int]] = {}
        for d, w in loads:
            if isinstance(w, PeerWeights) and w.route == "p2p":
                by_src.setdefault(w.src, []).append(d)
        return [self.calls.actor.send_kept(src, self.version, targets) for src, targets in by_src.items()]

    def forget(self) -> None:
        """Forget the step in progress and the weights its end would have kept (`tidal.pipeline.survivors`: every
        worker's calls have ended, their results are not wanted)."""
        self._keeping = []
        self.kept = frozenset()
        self.weights_ref = None
        self._shared = None

    def keep_at_step_end(self) -> None:
        """Step end, before the placement is restored (the actor shrinks back to its initial devices then): where
        each of the actor's ranks keeps a whole replica for the next version, so the engines that run there next
        load it in place (`sync`). Asked of every device, so the others drop an older copy (it could never
        be loaded again: its version is past). Not waited for: each worker runs it before the reshard queued behind
        it. With the scheduler on at TP 1 (TP > 1 would gather every step for the few lends that use it), and on
        static placements where the actor shares devices with an engine (any TP: the TP shards are all-gathered
        on the actor's devices)."""
        shares = self.sharing.actor_rollout or self.sharing.actor_inference
        if not shares and (not self.cfg.cluster.auto_scheduler or self.placement.actor.tp != 1):
            self._keeping = []
            return
        self._keeping = [(d, self.calls.actor.keep_weights(d, self.version + 1)) for d in self.group.world_ids]

    def sync(self, step: int) -> None:
        """The actor's weights to every rollout and inference engine (the next policy version). An engine whose
        device kept a copy at the step end (`keep_at_step_end`) loads that one in place, with no trip through the
        driver; the others get the weights gathered from the actor through the object store. With the actor
        spread over every device at the step end (the tidal policy's usual last iter) nothing travels (CPU e2e
        workload: 0.16-0.21 s gathered, 0.01 s from kept copies)."""
        c, g = self.cluster, self.group
        t0 = self.clock()
        keeping, self._keeping = self._keeping, []
        self.kept = frozenset(d for (d, _), ok in zip(keeping, g.gather([h for _, h in keeping])) if ok)
        self.version += 1
        remote = self._receivers(self.kept)
        plan = self._broadcast_plan(remote)
        self.load(plan or (g.put(self.global_weights()) if remote else None), step + 1)
        engines = list(self.placement.engines)
        c.timeline.add_busy(engines, "moving", "weight sync", t0, self.clock())
        c.record("weight_sync", step=step, version=self.version, seconds=self.clock() - t0,
                 local=sorted(set(engines) & self.kept), remote=remote,
                 path="broadcast" if plan else "driver" if remote else "kept")

    def _receivers(self, kept: frozenset[int]) -> list[int]:
        """Devices whose engine loads the step's weights from outside (`load`'s `weights_ref`): rollout
        devices without a kept copy, and inference devices without one that do not score with a rollout model."""
        share, p = self.sharing, self.placement
        inference = [d for d in p.inference if not (share.rollout_inference and d in p.rollout)]
        return sorted({d for d in (*p.rollout, *inference) if d not in kept})

    def _broadcast_plan(self, remote: list[int]) -> BroadcastWeights | None:
        """The engines of `remote` receive the weights by a broadcast from the actor's first device, over the group
        of those ranks (made world-wide the first time: every worker is between steps here). None, and the weights
        go through the object store, where a rank is not in the world (a replacement worker), or where a dynamic
        placement kept no copy at the step end: an instance the scheduler starts mid-step on another device loads
        the weights from a kept copy (`weights_for`)."""
        g = self.group
        if not remote or (self.cfg.cluster.auto_scheduler and not self.kept):
            return None
        src = self.placement.actor.devices[0]
        ranks = tuple(sorted({src, *remote}))
        if not set(ranks) <= set(g.world_ids):
            return None
        actuator = self.actuator
        if ranks not in actuator.rank_sets:
            g.gather(self.calls.actor.make_groups(g.world_ids, [ranks]))
            actuator.known_rank_sets([ranks])
        return BroadcastWeights(self.version, src, ranks)

    def global_weights(self) -> dict[str, torch.Tensor]:
        """Current actor weights in global coordinates (for checks and checkpoints of the driver)."""
        shards = [w for w in self.group.gather(self.calls.actor.weights(self.placement.actor.devices))
                  if w is not None]
        shards.sort(key=lambda w: w.tp_rank)
        return rollout_shard(self.spec.args, [s.tensors for s in shards], 1, 0)

