"""Typed records that cross the worker boundary (driver <-> device worker), besides the engine's own records
(`tidal.engine.records`: prompt, rollout and scored groups).

- `KeptWeights(version)`: the `weights` argument that tells an engine to load the copy its worker kept at the
  step end (`roles.actor_keep_weights`) instead of weights sent through the object store.
- `BroadcastWeights(version, src, ranks)`: the weights arrive by a broadcast from the actor's device `src` over
  the process group of `ranks` (device to device), sent by `roles.actor_broadcast_weights`.
- `RolloutReport`: what a rollout time slice reports besides its finished groups (engine counters, the slice's
  own time and tokens): the scheduler's view of the instance.
- `MigrationPackage`: the work an export froze (queued groups, open groups with their finished samples, engine
  states with their KV caches); `ExportReceipt`: what its source needs to commit or cancel it, without the KV
  caches; `MoveResult`: one move of a migration wave as its target saw it.
- `ReshardReport`: one rank's account of an actor reshard; `HandoverReport`: one device's account of handing it
  between training and generation (`roles.actor_offload`, `roles.actor_onload`).
- `RankWeights`: one TP rank's weights of the actor, as `roles.actor_weights` exports them.

All are frozen dataclasses of plain values, tensors and engine records; Ray carries them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, TypeAlias

import torch

from tidal.engine.transfer import CudaIpcTensor


@dataclass(frozen=True)
class KeptWeights:
    """Load the weights of `version` this worker kept (it must hold that version: else it is a driver bug)."""

    version: int


@dataclass(frozen=True)
class BroadcastWeights:
    """Receive the weights of `version` from device `src` (the actor's first device) by one broadcast per flat
    bucket (`tidal.engine.transfer.pack_buckets`: `param_specs` order, global shapes, the compute dtype) over the
    process group of `ranks`: NCCL between GPUs, gloo between CPU workers; no copy through the driver or the
    object store."""

    version: int
    src: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class PeerWeights:
    """Take the weights of `version` from the copy device `src` kept (`actor_keep_weights`: flat buckets in the
    compute dtype, `param_specs` order) by the transfer layer: `route` p2p, the buckets sent by `src`'s
    `actor_send_kept` call, which the driver submits beside this load; ipc, mapped from `handles` (`src` and this
    worker share a GPU). Never through the object store."""

    version: int
    src: int
    route: Literal["p2p", "ipc"]
    handles: tuple[CudaIpcTensor, ...] = ()


@dataclass(frozen=True)
class RolloutModel:
    """Score with the model of this worker's rollout engine, which holds `version` (one copy of the weights on a
    device rollout and inference share)."""

    version: int


@dataclass(frozen=True)
class RolloutReport:
    """One rollout instance after a time slice. Counters of the whole step: `tokens`, `emitted`; of this slice:
    `busy_s`, `pumps`, `mean_batch`, `call_tokens`, `gc_s`, `reward_timeouts`, `call_keys_read`,
    `call_prefill_tokens`, `call_preemptions`."""

    groups_in_progress: int = 0   #: groups opened in the engine, not finished
    running: int = 0              #: sequences running in the engine
    waiting: int = 0              #: sequences admitted, waiting for a slot
    progress: int = 0             #: tokens generated so far by unfinished sequences
    tokens: int = 0               #: tokens generated this step
    token_rate: float = 0.0       #: tokens per second, measured by the instance
    emitted: int = 0              #: groups finished this step
    queued: int = 0               #: groups in the local queue, not opened
    busy_s: float = 0.0
    pumps: int = 0                #: engine pumps (admit + one decode step)
    mean_batch: float = 0.0       #: sequences running, averaged over the pumps
    gc_s: float = 0.0             #: the worker's garbage-collector pauses
    call_tokens: int = 0          #: tokens generated in this slice
    reward_timeouts: int = 0      #: verifier calls cut by `reward.timeout_s`
    call_keys_read: int = 0       #: key positions decode rows attended over in this slice (the KV read)
    call_prefill_tokens: int = 0  #: prompt tokens prefilled in this slice, padding included
    call_preemptions: int = 0     #: requests preempted for want of KV blocks in this slice (re-prefilled later)

    @property
    def started(self) -> int:
        """Sequences in the engine (running or waiting)."""
        return self.running + self.waiting


@dataclass(frozen=True)
class ExportReceipt:
    """What a source settles an export with: the engine request ids, open group ids and queued groups it froze."""

    request_ids: tuple[str, ...]
    open: tuple[int, ...]
    queued: tuple[Any, ...]   #: `PromptGroup`s taken from the local queue


@dataclass(frozen=True)
class MoveSummary:
    """What the driver books for a move: sequences and their tokens, open and queued groups, KV bytes."""

    requests: int
    tokens: int
    open: int
    queued: int
    kv_bytes: int

    @property
    def groups(self) -> int:
        return self.open + self.queued


#: how a move's KV goes from its source to its target (`tidal.engine.transfer`): point to point in the world
#: (gloo / NCCL), CUDA IPC on one GPU, or not at all (an end outside the world: the target re-prefills, exactly)
KVRoute: TypeAlias = Literal["p2p", "ipc", "reprefill"]


@dataclass(frozen=True)
class MigrationPackage:
    """Frozen work on its way from a source instance to a target (`roles_migration.rollout_export`): small
    records only, the KV stays in the source's blocks until the transfer layer moves it."""

    queued: tuple[Any, ...]                 #: `PromptGroup`s not started
    open: dict[int, tuple[Any, Any]]        #: group id -> (group snapshot, its finished samples)
    states: tuple[Any, ...]                 #: engine `RequestState`s (naming their KV blocks)
    kv_pool: CudaIpcTensor | None = None    #: the source's KV pool, shared for a move whose route is ipc

    def receipt(self) -> ExportReceipt:
        return ExportReceipt(tuple(st.request_id for st in self.states), tuple(self.open), self.queued)

    def summary(self) -> MoveSummary:
        kv = sum(st.kv_nbytes if st.kv_blocks is not None else
                 sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in st.kv or ())
                 for st in self.states)
        return MoveSummary(len(self.states), sum(len(st.token_ids) for st in self.states), len(self.open),
                           len(self.queued), kv)


@dataclass(frozen=True)
class PackageRef:
    """Where a target finds one move's package: package `index` of its source's export call (`ref`), the
    source device and the route its KV takes."""

    ref: Any              #: the `ObjectRef` of the source's `rollout_export_many` result
    index: int
    source: int
    route: KVRoute


@dataclass(frozen=True)
class MoveResult:
    """One move of a wave as its target saw it. `ok`: imported (all or nothing). A failed import keeps the
    source's `receipt` (the driver cancels with it); a failed export has none (`exported` False)."""

    ok: bool
    summary: MoveSummary | None = None
    receipt: ExportReceipt | None = None
    error: str = ""
    exported: bool = True
    fetch_s: float = 0.0      #: the target's wait for (and fetch of) its wave's exports
    import_s: float = 0.0     #: the target's imports

    def timed(self, fetch_s: float, import_s: float) -> MoveResult:
        return replace(self, fetch_s=fetch_s, import_s=import_s)


@dataclass(frozen=True)
class ReshardReport:
    """One rank's account of a reshard: the plan's bytes (every rank reports the whole plan's), its own seconds
    (process-group creation excluded), the memory it holds after, and where the call's time went."""

    bytes_moved: int
    seconds: float
    held_bytes: int
    prepared: bool             #: the rank ran a program the driver prepared
    gc_s: float
    groups_s: float            #: creating the layout's process groups (first use: collective over the world)
    call_s: float              #: the whole call (layout sync, groups, reshard)
    phase_s: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class HandoverReport:
    """One device handed between training and generation: the bytes the actor's state moved and the seconds it
    took, the actor's bytes still on the device after, and (CUDA only, None on CPU) the device's memory at the end
    of the phase the hand-over ends: allocated then, and its peak since the previous hand-over."""

    bytes: float
    seconds: float
    actor_resident: float
    phase_allocated: float | None = None
    phase_peak: float | None = None

    def measured(self) -> dict[str, float]:
        """The fields this device measured, by name (the phase's memory on CUDA only)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @staticmethod
    def slowest(reports: Sequence[HandoverReport]) -> HandoverReport:
        """One hand-over over several devices: each field's largest value (the slowest device, the fullest)."""
        def top(values: list[float | None]) -> float | None:
            got = [v for v in values if v is not None]
            return max(got) if got else None

        return HandoverReport(max(r.bytes for r in reports), max(r.seconds for r in reports),
                              max(r.actor_resident for r in reports), top([r.phase_allocated for r in reports]),
                              top([r.phase_peak for r in reports]))


@dataclass(frozen=True)
class RankWeights:
    """The actor's weights held by TP rank `tp_rank` (its DP rank 0): CPU copies in the compute dtype, keyed by
    parameter name, TP-local shapes. The TP ranks' shards together make the global weights."""

    tp_rank: int
    tensors: dict[str, torch.Tensor]
