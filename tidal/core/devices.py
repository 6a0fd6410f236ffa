"""Device ownership, by id: who owns each device, how it may change hands, and the history of every move.

States and the allowed edges (anything else is refused, naming both states)::

    FREE ──► ACTOR | ROLLOUT | INFERENCE        placement at start, or a MOVING device landing
    ACTOR | ROLLOUT | INFERENCE ──► MOVING      its old role is releasing it (memory not yet freed)
    MOVING ──► ACTOR | ROLLOUT | INFERENCE      the old role has freed it; the new role takes it
    MOVING ──► FREE                              released with no taker yet
    ACTOR | ROLLOUT | INFERENCE ──► FREE         shutdown / end of run
    FREE ──► SHARED ──► FREE                     a static placement time-shares the device between components
                                                 (collocated, hybrid); it never moves while shared
    any state but FAILED ──► FAILED              its worker stopped answering (`DeviceFailure` says why)
    FAILED ──► FREE                              it answers again: it rejoins the free pool

A FAILED device is in no role: nothing is given to it and no role takes it until it is back in FREE.

A device is never in two roles: while its old role still holds memory on it, it is MOVING and no one can
take it ("never double-book"). Each transition records a reason and a timestamp from an injected clock.

    >>> ledger = DeviceLedger(range(4), clock=lambda: 0.0)
    >>> ledger.assign([0, 1], Owner.ACTOR, "placement")
    >>> ledger.release([1], "actor shrinks")          # ACTOR -> MOVING
    >>> ledger.land([1], Owner.ROLLOUT, "rollout grows")  # MOVING -> ROLLOUT
    >>> ledger.owned(Owner.ROLLOUT)
    (1,)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


class Owner(str, enum.Enum):
    FREE = "free"
    ACTOR = "actor"
    ROLLOUT = "rollout"
    INFERENCE = "inference"
    MOVING = "moving"
    SHARED = "shared"
    FAILED = "failed"


ROLES = (Owner.ACTOR, Owner.ROLLOUT, Owner.INFERENCE)

#: allowed (from, to) edges, each with why it exists.
TRANSITIONS: dict[tuple[Owner, Owner], str] = {
    **{(Owner.FREE, r): "a free device is placed in a role" for r in ROLES},
    **{(r, Owner.MOVING): "the role starts releasing the device" for r in ROLES},
    **{(Owner.MOVING, r): "the old role freed the device; the new role takes it" for r in ROLES},
    (Owner.MOVING, Owner.FREE): "released with no taker",
    **{(r, Owner.FREE): "the role shuts down" for r in ROLES},
    (Owner.FREE, Owner.SHARED): "a static placement shares the device between components",
    (Owner.SHARED, Owner.FREE): "the shared components shut down",
    **{(o, Owner.FAILED): "its worker stopped answering" for o in Owner if o is not Owner.FAILED},
    (Owner.FAILED, Owner.FREE): "its worker answers again: back in the free pool",
}


class IllegalTransition(RuntimeError):
    """A move the table does not allow; names the device and both states."""

    def __init__(self, device: int, src: Owner, dst: Owner):
        super().__init__(f"device {device}: {src.value} -> {dst.value} is not allowed "
                         f"(allowed from {src.value}: {[d.value for (s, d) in TRANSITIONS if s is src]})")
        self.device, self.src, self.dst = device, src, dst


@dataclass(frozen=True)
class DeviceFailure:
    """Device `device`'s worker stopped answering at `time` while it was `role`: `reason` says how it was found
    (process gone, Ray's actor-death error, no result within `cluster.failure_timeout_s`)."""

    device: int
    role: Owner
    reason: str
    time: float


@dataclass(frozen=True)
class Transition:
    """One history row: device `device` went from `src` to `dst` at `time` because of `reason`."""

    device: int
    src: Owner
    dst: Owner
    reason: str
    time: float


class DeviceLedger:
    """The single owner of device ownership state. Moves are all-or-nothing per call."""

    def __init__(self, devices: Iterable[int], clock: Callable[[], float] = time.monotonic):
        self._owner: dict[int, Owner] = {int(d): Owner.FREE for d in devices}
        self._clock = clock
        self.history: list[Transition] = []

    def owner(self, device: int) -> Owner:
        if device not in self._owner:
            raise KeyError(f"device {device} is not in this cluster (devices {sorted(self._owner)})")
        return self._owner[device]

    def owned(self, owner: Owner) -> tuple[int, ...]:
        return tuple(sorted(d for d, o in self._owner.items() if o is owner))

    def snapshot(self) -> dict[int, Owner]:
        return dict(self._owner)

    def _move(self, devices: Iterable[int], dst: Owner, reason: str, expect: tuple[Owner, ...] | None) -> None:
        self._move_many({dst: devices}, reason, expect)

    def _move_many(self, moves: Mapping[Owner, Iterable[int]], reason: str,
                   expect: tuple[Owner, ...] | None) -> None:
        """One move: every listed device to its destination at one clock reading, or none of them."""
        pairs = [(int(d), dst) for dst, devices in moves.items() for d in devices]
        ids = [d for d, _ in pairs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"devices listed twice in one move: {ids}")
        for d, dst in pairs:  # check all first: a refused move changes nothing
            src = self.owner(d)
            if (src, dst) not in TRANSITIONS or (expect is not None and src not in expect):
                raise IllegalTransition(d, src, dst)
        now = self._clock()
        for d, dst in pairs:
            self.history.append(Transition(d, self._owner[d], dst, reason, now))
            self._owner[d] = dst

    def assign(self, devices: Iterable[int], role: Owner, reason: str) -> None:
        """FREE -> role (or SHARED)."""
        self._move(devices, role, reason, (Owner.FREE,))

    def assign_many(self, roles: Mapping[Owner, Iterable[int]], reason: str) -> None:
        """FREE -> several roles as one move (one time in the history: a placement is one change, not one per
        role)."""
        self._move_many(roles, reason, (Owner.FREE,))

    def release(self, devices: Iterable[int], reason: str) -> None:
        """role -> MOVING (the old role still holds memory until `land` or `free`)."""
        self._move(devices, Owner.MOVING, reason, ROLES)

    def land(self, devices: Iterable[int], role: Owner, reason: str) -> None:
        """MOVING -> role, once the old role has freed the device."""
        self._move(devices, role, reason, (Owner.MOVING,))

    def free(self, devices: Iterable[int], reason: str) -> None:
        """MOVING, role or SHARED -> FREE."""
        self._move(devices, Owner.FREE, reason, (Owner.MOVING, Owner.SHARED, *ROLES))

    def fail(self, device: int, reason: str) -> DeviceFailure:
        """Any state -> FAILED: its worker stopped answering. Returns the failure (the role it had)."""
        role = self.owner(device)
        self._move([device], Owner.FAILED, reason, None)
        return DeviceFailure(int(device), role, reason, self.history[-1].time)

    def rejoin(self, device: int, reason: str) -> None:
        """FAILED -> FREE: the device answers again and rejoins the free pool."""
        self._move([device], Owner.FREE, reason, (Owner.FAILED,))
