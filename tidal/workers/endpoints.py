"""Role endpoints: the driver's typed calls into the role functions of `tidal.workers.roles`, one small class per
role, each a thin layer over a `WorkerGroup`.

A method submits one role function (on one device, or on each of several) with the arguments that function
takes, and returns at once with typed `CallHandle`s; `WorkerGroup.gather` turns them into the records::

    driver                                   device workers
    ──────                                   ──────────────
    rollout.run_slice(3, groups, 0.1, seq) ─► roles_rollout.rollout_run(ctx, groups=..., budget_s=..., seq=...)
      -> CallHandle[tuple[list[RolloutGroup], RolloutReport]]
    inference.score(4, groups)             ─► roles.inference_score(ctx, groups=...)
      -> CallHandle[list[ScoredGroup]]
    group.gather([...])                    ◄─ the records, in order (or WorkerDied / WorkerCallError / ...)

Nothing here waits, retries or keeps state: every guarantee (ordering per worker, deaths, interrupts) is the
group's. Calls that take many devices take them in the order given and return their handles in that order.

Example::

    calls = Endpoints.on(group)
    ref = group.put(samples)
    metrics = group.gather(calls.actor.train_iter(layout.devices, ref, num_tokens))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tidal.engine.backends.protocol import CheckpointLoad, ProgramInputs
from tidal.engine.checkpoint import CheckpointMeta, ShardRecord
from tidal.engine.evaluation import EvalItem
from tidal.engine.grpo import ScoredSample
from tidal.engine.layout import Layout
from tidal.engine.records import RolloutGroup, ScoredGroup
from tidal.engine.reshard import PreparedProgram
from tidal.engine.transfer import CudaIpcTensor
from tidal.workers import roles, roles_ckpt, roles_migration, roles_rollout
from tidal.workers.messages import (
    BroadcastWeights,
    ExportReceipt,
    HandoverReport,
    KVRoute,
    MigrationPackage,
    MoveResult,
    PackageRef,
    RankWeights,
    ReshardReport,
    RolloutModel,
    RolloutReport,
)
from tidal.workers.roles import EngineWeights, GlobalWeights, RunSpec
from tidal.workers.rollout_instance import PromptGroup
from tidal.workers.runtime import CallHandle, WorkerGroup

if TYPE_CHECKING:
    from ray import ObjectRef


class WorkerCalls:
    """What every worker does whatever its role: take the run, freeze its collector, drop its engines."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def setup(self, devices: Sequence[int], spec: RunSpec) -> list[CallHandle[int]]:
        """Each worker takes the run (`roles.setup`); each returns its device id."""
        return self.group.submit_all(roles.setup, devices, spec=spec)

    def freeze_gc(self, devices: Sequence[int]) -> list[CallHandle[None]]:
        return self.group.submit_all(roles.freeze_gc, devices)

    def abandon_engines(self, devices: Sequence[int]) -> list[CallHandle[None]]:
        """Drop every engine, its requests included, and any kept weights (a step abandoned)."""
        return self.group.submit_all(roles.abandon_engines, devices)


class ActorCalls:
    """The actor's calls: build, train, reshard, hand devices over, export and keep weights, checkpoints."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def init(self, devices: Sequence[int], layout: Layout,
             weights: GlobalWeights | ObjectRef[dict[str, torch.Tensor] | None] | None) -> list[CallHandle[str]]:
        """Every worker of the world builds its backend (holding state if in `layout`); each says what it built."""
        return self.group.submit_all(roles.actor_init, devices, layout=layout, weights=weights)

    def program_inputs(self, device: int) -> CallHandle[ProgramInputs | None]:
        return self.group.submit(device, roles.actor_program_inputs)

    def make_groups(self, devices: Sequence[int], rank_sets: Sequence[Sequence[int]]) -> list[CallHandle[float]]:
        """Every live rank of the world, in one order: these rank sets' process groups; each returns seconds."""
        return self.group.submit_all(roles.actor_make_groups, devices, rank_sets=rank_sets)

    def train_iter(self, devices: Sequence[int], samples_ref: ObjectRef[list[ScoredSample]],
                   num_tokens: int) -> list[CallHandle[dict[str, float] | None]]:
        """One optimizer step on the iter's samples (put once, `WorkerGroup.put`) on the layout's `devices`;
        each member returns its metrics (None outside the layout)."""
        return self.group.submit_all(roles.actor_train_iter, devices, samples=samples_ref, num_tokens=num_tokens)

    def score(self, devices: Sequence[int],
              groups: list[RolloutGroup]) -> list[CallHandle[list[list[torch.Tensor]] | None]]:
        """The actor's own log-probs of `groups` (collective over the layout; one rank returns them)."""
        return self.group.submit_all(roles.actor_score, devices, groups=groups)

    def reshard(self, device: int, layout: Layout, current: Layout | None, local: bool,
                prepared: PreparedProgram | None = None) -> CallHandle[ReshardReport]:
        """One rank of a reshard to `layout` (submit it on every rank the move involves)."""
        return self.group.submit(device, roles.actor_reshard, layout=layout, current=current, local=local,
                                 prepared=prepared)

    def set_layout(self, devices: Sequence[int], layout: Layout) -> list[CallHandle[None]]:
        """Workers outside a member-local reshard learn the new layout, behind their current call."""
        return self.group.submit_all(roles.actor_set_layout, devices, layout=layout)

    def weights(self, devices: Sequence[int]) -> list[CallHandle[RankWeights | None]]:
        """Each TP rank's weights (from DP rank 0 of each; None from the others)."""
        return self.group.submit_all(roles.actor_weights, devices)

    def keep_weights(self, device: int, version: int) -> CallHandle[bool]:
        return self.group.submit(device, roles.actor_keep_weights, version=version)

    def kept_weights(self, device: int, version: int) -> CallHandle[dict[str, torch.Tensor]]:
        return self.group.submit(device, roles.kept_weights, version=version)

    def send_kept(self, device: int, version: int, targets: Sequence[int]) -> CallHandle[int]:
        """The kept copy of `version` to each target in order, point to point (each loads `PeerWeights`)."""
        return self.group.submit(device, roles.actor_send_kept, version=version, targets=targets)

    def share_kept(self, device: int, version: int) -> CallHandle[tuple[CudaIpcTensor, ...]]:
        """CUDA IPC handles of the kept copy's buckets (engines on the same GPU map them)."""
        return self.group.submit(device, roles.actor_share_kept, version=version)

    def drop_kept(self, devices: Sequence[int]) -> list[CallHandle[None]]:
        return self.group.submit_all(roles.drop_kept, devices)

    def broadcast_weights(self, devices: Sequence[int], plan: BroadcastWeights) -> list[CallHandle[int]]:
        """The actor's weights to the engines of `plan.ranks` (`devices`: `plan.src`, or the whole layout at TP > 1);
        each returns the bytes it sent."""
        return self.group.submit_all(roles.actor_broadcast_weights, devices, plan=plan)

    def offload(self, device: int, optimizer: bool, grad: bool, weight: bool) -> CallHandle[HandoverReport]:
        """Hand `device` to generation: the actor's state there to host memory as the flags say."""
        return self.group.submit(device, roles.actor_offload, optimizer=optimizer, grad=grad, weight=weight)

    def onload(self, device: int) -> CallHandle[HandoverReport]:
        """Hand `device` back to training: what `offload` moved comes back."""
        return self.group.submit(device, roles.actor_onload)

    def save(self, devices: Sequence[int], dir: str, gen: int, meta: CheckpointMeta
             ) -> list[CallHandle[ShardRecord | None]]:
        """The layout's ranks write their shards of generation `gen` under `dir` (collective over the layout)."""
        return self.group.submit_all(roles_ckpt.actor_save, devices, dir=dir, gen=gen, meta=meta)

    def load(self, devices: Sequence[int], dir: str, layout: Layout, ranks: tuple[int, ...] | None = None
             ) -> list[CallHandle[CheckpointLoad]]:
        """Every live rank of the world loads the generation at `dir` resharded to `layout` (`ranks`: the live
        ones, when the world lost some)."""
        return self.group.submit_all(roles_ckpt.actor_load, devices, dir=dir, layout=layout, ranks=ranks)


class RolloutCalls:
    """A rollout instance's calls (instance id == its device id): start, time slices, migration, release."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def start(self, device: int, weights: EngineWeights | None, version: int, step: int) -> CallHandle[str]:
        """Become the instance of `step` with weights `version` (`weights` None: keep the engine of that version)."""
        return self.group.submit(device, roles_rollout.rollout_start, instance_id=str(device), weights=weights,
                                 version=version, step=step)

    def run_slice(self, device: int, groups: list[PromptGroup], budget_s: float,
                  seq: int) -> CallHandle[tuple[list[RolloutGroup], RolloutReport]]:
        """One time slice numbered `seq` (an interrupt `roles_rollout.ROLLOUT_INTERRUPT` up to `seq` ends it early)."""
        return self.group.submit(device, roles_rollout.rollout_run, groups=groups, budget_s=budget_s, seq=seq)

    def holding(self, devices: Sequence[int]) -> list[CallHandle[list[tuple[int, int]]]]:
        """The group ids each instance holds and has not returned."""
        return self.group.submit_all(roles_rollout.rollout_holding, devices)

    def export_many(self, device: int, counts: Sequence[int | None],
                    routes: Sequence[KVRoute]) -> CallHandle[list[MigrationPackage]]:
        """Freeze the next groups, `counts[k]` for package k (None: all that is left), its KV left in place for
        route `routes[k]`."""
        return self.group.submit(device, roles_migration.rollout_export_many, counts=counts, routes=routes)

    def send_kv(self, device: int, sends: Sequence[tuple[int, int]]) -> CallHandle[int]:
        """Stream the KV of package k of the last export to target device t, for each (k, t) in the wave's
        order (p2p moves only)."""
        return self.group.submit(device, roles_migration.rollout_send_kv, sends=sends)

    def import_from(self, device: int, sources: Sequence[PackageRef]) -> CallHandle[list[MoveResult]]:
        """Import each named package (by its export's `CallHandle.ref`), its KV by the move's route, in order."""
        return self.group.submit(device, roles_migration.rollout_import_from, sources=sources)

    def settle_exports(self, device: int, receipts: Sequence[ExportReceipt],
                       commit: Sequence[bool]) -> CallHandle[None]:
        """Commit (the target imported) or cancel each export of this source, in order."""
        return self.group.submit(device, roles_migration.rollout_settle_exports, receipts=receipts, commit=commit)

    def free_kv(self, devices: Sequence[int]) -> list[CallHandle[None]]:
        """Generation is done on `devices`: free the engines' KV caches, keep their weights for scoring."""
        return self.group.submit_all(roles_rollout.rollout_free_kv, devices)

    def release(self, device: int) -> CallHandle[int]:
        """Stop being an instance and free the engine (refused with requests in flight)."""
        return self.group.submit(device, roles_rollout.rollout_release)


class InferenceCalls:
    """The scorer's calls: load weights, score groups, evaluate, release."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    def load(self, device: int, weights: EngineWeights | RolloutModel, version: int) -> CallHandle[int]:
        """Score with the weights of `version` from now on (`RolloutModel`: the rollout engine's model here)."""
        return self.group.submit(device, roles.inference_load, weights=weights, version=version)

    def score(self, device: int, groups: list[RolloutGroup]) -> CallHandle[list[ScoredGroup]]:
        """Old-policy log-probs of `groups`, each scored as its own batch."""
        return self.group.submit(device, roles.inference_score, groups=groups)

    def evaluate(self, device: int, items: list[EvalItem]) -> CallHandle[float]:
        """Greedy held-out accuracy with the weights loaded here."""
        return self.group.submit(device, roles.evaluate, items=items)

    def release(self, device: int) -> CallHandle[None]:
        return self.group.submit(device, roles.inference_release)


@dataclass(frozen=True)
class Endpoints:
    """Every role's calls on one group."""

    worker: WorkerCalls
    actor: ActorCalls
    rollout: RolloutCalls
    inference: InferenceCalls

    @classmethod
    def on(cls, group: WorkerGroup) -> Endpoints:
        return cls(WorkerCalls(group), ActorCalls(group), RolloutCalls(group), InferenceCalls(group))
