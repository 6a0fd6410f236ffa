"""Component placement: RLinf's `cluster.component_placement` syntax, parsed into device-id sets.

Syntax (RLinf's, accepted as is)::

    component_placement:
      actor: 0-1            # a range, inclusive
      rollout: 2-5
      inference: 6,7        # single ids, comma separated; "0-1,4-5" mixes both
      "actor,rollout": 0-7  # one key naming several components shares those devices

Modes, derived (never configured):
- collocated: every component runs on the same device set;
- disaggregated: components run on pairwise disjoint device sets;
- auto: disaggregated with `auto_scheduler: True`; then the devices must run contiguously in the order
  actor -> rollout -> inference with the actor starting at device 0, because the actor grows into the
  devices that rollout releases next to it, and rollout into those inference releases.
Partially shared placements (two components share, the third apart) are "hybrid". Collocated and hybrid
placements run static: the components sharing a device take turns on it (tidal/pipeline/sharing.py).
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass

from tidal.core.errors import ConfigError

MAX_DEVICES = 1 << 16   # the most device ids a placement may name: checked before a range is expanded

COMPONENTS = ("actor", "rollout", "inference")
#: components RLinf knows that Tidal's pipeline has no role for in auto mode (refused there, with a reason).
AUTO_REFUSED = ("critic", "reward")


class Mode(str, enum.Enum):
    COLLOCATED = "collocated"
    DISAGGREGATED = "disaggregated"
    AUTO = "auto"
    HYBRID = "hybrid"


def parse_device_ids(spec: object, field: str) -> tuple[int, ...]:
    """`"0-3"`, `"0-1,4-5"`, `5`, `"6,7"` -> sorted unique ids. Errors name `field`."""
    if isinstance(spec, bool) or spec is None:
        raise ConfigError(field, spec, "is not a device list", 'write a range like "0-3", ids like "0,2", or one id')
    if isinstance(spec, int):
        parts = [str(spec)]
    elif isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",")]
    else:
        raise ConfigError(field, spec, "is not a device list", 'write a range like "0-3", ids like "0,2", or one id')
    ids: list[int] = []
    for part in parts:
        if not part:
            raise ConfigError(field, spec, "has an empty entry", 'remove the stray comma, e.g. "0-1,4-5"')
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise ConfigError(field, spec, f"entry {part!r} is not an id or a range of ids",
                              'use non-negative integers, e.g. "2-5"') from None
        if lo < 0 or hi < 0:
            raise ConfigError(field, spec, "device ids must be non-negative", 'e.g. "0-3"')
        if hi < lo:
            raise ConfigError(field, spec, f"range {part!r} runs backwards", f'write "{hi}-{lo}"')
        if hi >= MAX_DEVICES:
            raise ConfigError(field, spec, f"device id {hi} is past the largest cluster ({MAX_DEVICES:,} devices)",
                              "use ids of this cluster's devices, 0 to num_nodes x num_devices_per_node - 1")
        ids.extend(range(lo, hi + 1))
    if len(set(ids)) != len(ids):
        raise ConfigError(field, spec, "lists a device twice", "list each device id once")
    return tuple(sorted(ids))


@dataclass(frozen=True)
class Placement:
    """Which device ids each component starts on, and the mode that follows from them."""

    actor: tuple[int, ...]
    rollout: tuple[int, ...]
    inference: tuple[int, ...]
    num_devices: int
    mode: Mode

    def of(self, component: str) -> tuple[int, ...]:
        return getattr(self, component)

    def owners(self) -> dict[int, tuple[str, ...]]:
        """device id -> components placed on it (empty tuple: free)."""
        return {d: tuple(c for c in COMPONENTS if d in self.of(c)) for d in range(self.num_devices)}


def parse_placement(raw: dict, num_devices: int, auto_scheduler: bool,
                    field: str = "cluster.component_placement") -> Placement:
    """Parse and validate RLinf's placement mapping for a cluster of `num_devices` devices."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(field, raw, "must map component names to devices",
                          'e.g. {actor: "0-1", rollout: "2-5", inference: "6-7"}')
    sets = _read_entries(raw, num_devices, auto_scheduler, field)
    _check_complete(sets, num_devices, field)
    mode = _mode(sets, auto_scheduler)
    if auto_scheduler:
        _check_auto(sets, mode, field)
    return Placement(actor=sets["actor"], rollout=sets["rollout"], inference=sets["inference"],
                     num_devices=num_devices, mode=mode)


def _read_entries(raw: dict, num_devices: int, auto_scheduler: bool, field: str) -> dict[str, tuple[int, ...]]:
    """component -> device ids, entry by entry; an entry's devices are its own unless its key names several
    components."""
    sets: dict[str, tuple[int, ...]] = {}
    taken: dict[int, str] = {}  # device -> entry key: entries are disjoint; sharing is said with "a,b" keys
    for key, spec in raw.items():
        names = [n.strip() for n in str(key).split(",")]
        # RLinf's `all`: every device of the cluster
        ids = tuple(range(num_devices)) if isinstance(spec, str) and spec.strip() == "all" else \
            parse_device_ids(spec, f"{field}.{key}")
        for name in names:
            _check_name(name, key, spec, sets, auto_scheduler, field)
            sets[name] = ids
        clash = sorted(d for d in ids if d in taken)
        if clash:
            other = taken[clash[0]]
            raise ConfigError(f"{field}.{key}", spec, f"devices {clash} are also placed by entry {other!r}",
                              f'give each entry its own devices, or share them with one key such as '
                              f'"{other},{key}"')
        taken.update({d: str(key) for d in ids})
    return sets


def _check_name(name: str, key: object, spec: object, sets: dict[str, tuple[int, ...]], auto_scheduler: bool,
                field: str) -> None:
    """`name`, read from entry `key`, is one of Tidal's components and not placed by an earlier entry."""
    if name in AUTO_REFUSED:
        if auto_scheduler:
            raise ConfigError(f"{field}.{key}", spec,
                              f"a {name} placement cannot be scheduled dynamically (RLinf silently "
                              f"falls back to static; Tidal refuses)",
                              f"remove the {name} entry or set cluster.auto_scheduler: false")
        raise ConfigError(f"{field}.{key}", spec, f"component {name!r} is not part of Tidal's pipeline",
                          "use actor, rollout and inference (GRPO needs no critic)")
    if name not in COMPONENTS:
        near = difflib.get_close_matches(name, COMPONENTS, n=1)
        hint = f"did you mean {near[0]!r}?" if near else f"use one of {', '.join(COMPONENTS)}"
        raise ConfigError(f"{field}.{key}", name, "unknown component", hint)
    if name in sets:
        raise ConfigError(f"{field}.{key}", name, "component placed twice", "give each component one entry")


def _check_complete(sets: dict[str, tuple[int, ...]], num_devices: int, field: str) -> None:
    """Every component is placed, on devices of this cluster."""
    for name in COMPONENTS:
        if name not in sets:
            raise ConfigError(field, sorted(sets), f"no placement for {name}", f"add a `{name}:` entry")
    for name, ids in sets.items():
        bad = [d for d in ids if d >= num_devices]
        if bad:
            raise ConfigError(f"{field}.{name}", bad, f"device ids beyond the cluster's {num_devices} devices "
                              f"(ids 0-{num_devices - 1})",
                              "lower the ids or raise cluster.num_nodes / cluster.num_devices_per_node")


def _mode(sets: dict[str, tuple[int, ...]], auto_scheduler: bool) -> Mode:
    """The mode that follows from which components share devices (see module doc)."""
    a, r, i = (set(sets[c]) for c in COMPONENTS)
    if a == r == i:
        return Mode.COLLOCATED
    if not (a & r or a & i or r & i):
        return Mode.AUTO if auto_scheduler else Mode.DISAGGREGATED
    return Mode.HYBRID


def _check_auto(sets: dict[str, tuple[int, ...]], mode: Mode, field: str) -> None:
    """auto_scheduler's layout: disjoint sets, contiguous in the order actor -> rollout -> inference from 0."""
    if mode is not Mode.AUTO:
        a, r, i = (set(sets[c]) for c in COMPONENTS)
        shared = sorted((a & r) | (a & i) | (r & i))
        raise ConfigError(field, shared, "auto_scheduler moves devices between components at run time, so "
                          "each device must start in exactly one (these are shared)",
                          "give actor, rollout and inference separate ranges, or set auto_scheduler: false "
                          "(the shared placement then runs static, its components taking turns)")
    order = list(sets["actor"]) + list(sets["rollout"]) + list(sets["inference"])
    if order != list(range(len(order))):
        raise ConfigError(field, {c: sets[c] for c in COMPONENTS},
                          "auto_scheduler needs contiguous devices in the order actor -> rollout -> "
                          "inference, the actor starting at device 0 (the actor grows into devices "
                          "rollout releases next to it)",
                          f'e.g. actor: "0-{len(sets["actor"]) - 1}", rollout: next ids, inference: the last')


def format_ids(ids: tuple[int, ...] | list[int]) -> str:
    """(0,1,2,5) -> "0-2,5"."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(f"{ids[i]}-{ids[j]}" if j > i else f"{ids[i]}")
        i = j + 1
    return ",".join(out)
