"""Actions: what a policy asks for, typed, each with a `reason`.

A policy returns a list of actions; a driver (the simulator, or the reconciler acting on real workers) applies
them in list order. Every action is complete: devices by id, instance ids, layouts before and after, group
counts, so applying one needs no further decision.

Order of a typical list (RLinf's visiting order, kept by both policies)::

    MigrateRequests(src=2, dst=4, count=7)    move groups off an instance that is about to go
    ReleaseRollout(instance_ids=(2,), ...)    its devices: ROLLOUT -> MOVING -> FREE
    ReleaseInference(devices=(6, 7))          INFERENCE -> MOVING -> FREE
    ReshardActor(from_layout, to_layout)      FREE devices join the actor (or actor devices leave)

`Wait` holds the actor at its iter boundary: the driver asks again at its next event (or after `recheck_s`).
A list without `Wait` lets a boundary-waiting actor proceed.

Which groups a `MigrateRequests` moves is fixed by rule, not chosen by the actuator: the last `count`
unfinished groups in the source's queue order (so groups that have not started go first, then the most
recently admitted ones). Migration is abort + resubmit with `prompt + generated so far` (re-prefill), or, with
`kv=True`, a copy of the sequences' KV cache to the target (Tidal's native engine: `tidal/engine/generation`
migration; no re-prefill, cost = KV bytes / link bandwidth).

`StartRollout` (new in the tidal policy's mid-step lending) starts rollout instances on FREE devices (e.g.
devices the actor just left by shrinking); they receive work by `MigrateRequests` in the same list.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.signals import ActorLayout


@dataclass(frozen=True)
class Action:
    reason: str


@dataclass(frozen=True)
class Wait(Action):
    """Do nothing now; hold a boundary-waiting actor. `recheck_s`: ask me again after this long at the latest."""

    recheck_s: float | None = None


@dataclass(frozen=True)
class MigrateRequests(Action):
    """Move the last `count` unfinished groups of instance `src` to instance `dst` (abort + resubmit)."""

    src: int
    dst: int
    count: int
    kv: bool = False   #: move the KV cache (native engine) instead of abort + resubmit (re-prefill)


@dataclass(frozen=True)
class MigrateBatch(Action):
    """Many migrations in one action: `moves[k] = (src, dst, count)`, applied in order, each exactly as
    `MigrateRequests(src, dst, count, kv)`. A decision at 1,024 devices can move groups between hundreds of
    instance pairs; one action with a tuple keeps that O(moves) in cheap tuples, not O(moves) records."""

    moves: tuple[tuple[int, int, int], ...]
    kv: bool = False

    def expand(self) -> list[MigrateRequests]:
        return [MigrateRequests(self.reason, s, d, c, self.kv) for s, d, c in self.moves]

    @property
    def dsts(self) -> tuple[int, ...]:
        return tuple(sorted({d for _, d, _ in self.moves}))


@dataclass(frozen=True)
class ReleaseRollout(Action):
    """Finish instances `instance_ids` (their work already migrated to `migrate_to`); free `devices`."""

    instance_ids: tuple[int, ...]
    devices: tuple[int, ...]
    migrate_to: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReleaseInference(Action):
    """Inference has scored everything: offload it and free `devices`."""

    devices: tuple[int, ...]


@dataclass(frozen=True)
class ReshardActor(Action):
    """Move the actor's state from `from_layout` to `to_layout` (plan, execute, commit).

    Devices in `to_layout` not in `from_layout` must be FREE; devices leaving become FREE.
    """

    from_layout: ActorLayout
    to_layout: ActorLayout


@dataclass(frozen=True)
class LendToRollout(Action):
    """The actor's `devices` (weights and optimizer offloaded) host new rollout instances `instance_ids`.

    Instance `instance_ids[k]` runs on `devices[k*tp:(k+1)*tp]` (tp: rollout tensor parallel size). The actor
    keeps its layout but cannot train until the devices come back.
    """

    devices: tuple[int, ...]
    instance_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReturnFromRollout(Action):
    """Lent instances `instance_ids` (work already migrated away) stop; `devices` go back to the actor."""

    instance_ids: tuple[int, ...]
    devices: tuple[int, ...]
    migrate_to: tuple[int, ...] = ()


@dataclass(frozen=True)
class StartRollout(Action):
    """Start rollout instances `instance_ids` on FREE (or just released) `devices`: instance `instance_ids[k]`
    on `devices[k*tp:(k+1)*tp]`. They count as ordinary instances (released by `ReleaseRollout`)."""

    devices: tuple[int, ...]
    instance_ids: tuple[int, ...]


@dataclass(frozen=True)
class LendInference(Action):
    """Inference's idle `devices` (whole inference instances) host rollout instances `instance_ids` (instance
    `instance_ids[k]` on `devices[k*tp:(k+1)*tp]`, tp: rollout TP). Groups generated meanwhile wait for
    scoring until `ReturnToInference`. Tidal uses it at step start, before any group is generated."""

    devices: tuple[int, ...]
    instance_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReturnToInference(Action):
    """Lent-from-inference instances `instance_ids` (work already migrated to `migrate_to`) stop; `devices`
    score again."""

    instance_ids: tuple[int, ...]
    devices: tuple[int, ...]
    migrate_to: tuple[int, ...] = ()


def describe(actions: list[Action]) -> list[str]:
    """One line per action (logs, the simulator's event list)."""
    out = []
    for a in actions:
        if isinstance(a, ReshardActor):
            f, t = a.from_layout, a.to_layout
            body = f"tp{f.tp}xdp{f.dp}({f.size}) -> tp{t.tp}xdp{t.dp}({t.size})"
        elif isinstance(a, MigrateRequests):
            body = f"{a.count} groups {a.src} -> {a.dst}" + (" (kv)" if a.kv else "")
        elif isinstance(a, MigrateBatch):
            body = (f"{sum(c for _, _, c in a.moves)} groups in {len(a.moves)} moves "
                    f"{list(a.moves[:3])}{'...' if len(a.moves) > 3 else ''}" + (" (kv)" if a.kv else ""))
        elif isinstance(a, (ReleaseRollout, ReturnFromRollout, ReturnToInference)):
            body = f"instances {list(a.instance_ids)} devices {list(a.devices)}"
        elif isinstance(a, (LendToRollout, StartRollout, LendInference)):
            body = f"devices {list(a.devices)} as instances {list(a.instance_ids)}"
        elif isinstance(a, ReleaseInference):
            body = f"devices {list(a.devices)}"
        else:
            body = ""
        out.append(f"{type(a).__name__} {body}: {a.reason}".replace("  ", " "))
    return out
