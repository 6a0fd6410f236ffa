"""Process groups of actor layouts, created once per layout and cached.

`dist.new_group` is collective over the whole world: every live world rank must create the same groups in the same
order, including ranks that are not members (they get a non-member handle and never use it). torch names a group
by that order and waits for no rank outside it, so a world that lost a rank goes on making groups among the others
(`tidal.pipeline.survivors`). So `GroupCache.get`
must be called by every world rank with the same layout at the same point (`ActorShard.__init__` and
`ActorShard.reshard` do). For each layout, in this order: every TP group (d = 0..dp-1), every DP group
(t = 0..tp-1), then the group of all the layout's ranks; a rank set that already has a group (from this or an
earlier layout) reuses it. Groups of one rank are not created (`None`: no
communication needed), which every rank decides identically from the layout alone. torch orders a group's
ranks by id, so a TP group's devices must be increasing (its group rank is the TP shard index); DP groups may
be in any order (users map group ranks through `dp_order`).

    cache = GroupCache()
    g = cache.get(Layout(2, 2, (0, 1, 2, 3)))   # on every world rank
    g.tp, g.dp, g.all                           # this rank's groups (None: size 1 or not a member)

Member-local resharding: a reshard between layouts `a` and `b` votes on the group of the ranks in either
(`union_ranks`). `reshard_rank_sets(a, b)` lists every rank set such a reshard needs, in creation order; a
driver that mirrors which sets exist (it sees every world-wide call) can tell when a reshard needs no new
group and then calls only the ranks in `a` or `b`: the others keep working (rollout keeps generating).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import torch.distributed as dist

from tidal.core.errors import LayoutError
from tidal.engine.layout import Layout


@dataclass(frozen=True)
class LayoutGroups:
    """This rank's groups in one layout; None when the group has one rank or this rank is not a member."""

    layout: Layout
    rank: int
    tp: object | None
    dp: object | None
    all: object | None

    @property
    def member(self) -> bool:
        return self.layout.coord(self.rank) is not None


class GroupCache:
    """Creates each layout's groups once per process (collective over the world; see module doc)."""

    def __init__(self) -> None:
        self._groups: dict[Layout, LayoutGroups] = {}
        self._by_ranks: dict[tuple[int, ...], object] = {}  # one group per rank set, shared by layouts

    def get(self, layout: Layout) -> LayoutGroups:
        if layout not in self._groups:
            world, rank = dist.get_world_size(), dist.get_rank()
            if max(layout.devices) >= world:
                raise LayoutError("layout.devices", str(layout), f"uses device {max(layout.devices)} but the "
                                  f"world has {world} ranks", f"use device ids below {world}")
            for d in range(layout.dp):  # torch orders a group's ranks by id; the TP shard index is that order
                g = layout.tp_group(d)
                if list(g) != sorted(g):
                    raise LayoutError("layout.devices", str(layout), f"TP group {g} is not in increasing order",
                                      "list the devices of each TP group in increasing order")
            coord = layout.coord(rank)
            tp = dp = everyone = None
            sets = layout_rank_sets(layout)
            made = [self._new(r) for r in sets]
            if coord is not None:   # sets: TP groups (d order), DP groups (t order), all: pick this rank's
                tp, dp, everyone = made[coord[1]], made[layout.dp + coord[0]], made[-1]
            self._groups[layout] = LayoutGroups(layout, rank, tp, dp, everyone)
        return self._groups[layout]

    def union(self, a: Layout, b: Layout):
        """The group of the ranks in `a` or `b` (created on first use: collective over the world, so every world
        rank calls this at the same point, as `get`). None when that is one rank."""
        return self._new(union_ranks(a, b))

    def ensure(self, rank_sets) -> None:
        """Make these rank sets' groups now (collective over the world: same list, same order, every rank)."""
        for r in rank_sets:
            self._new(tuple(r))

    def of_ranks(self, ranks) -> object | None:
        """The group of exactly these ranks (created on first use: collective over the world, like `get`). None
        when that is one rank."""
        return self._new(tuple(ranks))

    def has(self, ranks: tuple[int, ...]) -> bool:
        key = tuple(sorted(ranks))
        return len(key) < 2 or key in self._by_ranks


    def _new(self, ranks: tuple[int, ...]):
        """The group of a rank set, created on first use (every rank decides this identically from the layouts
        it has seen, so the world's `new_group` calls stay in step). Layouts share groups: with tp = 1 the DP
        group is the whole layout, and a layout met again after a reshard costs nothing."""
        key = tuple(sorted(ranks))
        if len(key) < 2:
            return None
        if key not in self._by_ranks:
            self._by_ranks[key] = dist.new_group(list(key))
        return self._by_ranks[key]


def layout_rank_sets(layout: Layout) -> list[tuple[int, ...]]:
    """The rank sets of `layout`'s groups in creation order: TP groups (d = 0..dp-1), DP groups (t = 0..tp-1),
    all of its ranks. Sets of one rank get no group."""
    return ([layout.tp_group(d) for d in range(layout.dp)] + [layout.dp_group(t) for t in range(layout.tp)]
            + [layout.devices])


def union_ranks(a: Layout, b: Layout) -> tuple[int, ...]:
    return tuple(sorted(set(a.devices) | set(b.devices)))


def reshard_rank_sets(a: Layout, b: Layout) -> list[tuple[int, ...]]:
    """Every rank set (as sorted tuples, size >= 2) a reshard a -> b uses: b's groups and the union's."""
    return [tuple(sorted(r)) for r in layout_rank_sets(b) + [union_ranks(a, b)] if len(r) >= 2]


def growth_rank_sets(initial: Layout, devices, limit: int = 256) -> list[tuple[int, ...]]:
    """Rank sets of every layout the actor can grow to from `initial` by adding any subset of the other
    `devices` (ranks of the world; keeping its own, whole TP groups), and of the moves between those layouts and
    back: made once at start, they turn every later grow / shrink into a member-local reshard. Empty when there
    would be more than `limit` such layouts (large clusters: groups are then made on first use, world-wide)."""
    others = [d for d in sorted(devices) if d not in initial.devices]
    if 2 ** len(others) > limit:
        return []
    out: dict[tuple[int, ...], None] = {}
    tp = initial.tp
    for k in range(1, len(others) + 1):
        for extra in combinations(others, k):
            devs = tuple(sorted(initial.devices + extra))
            if len(devs) % tp:
                continue
            grown = Layout(tp, len(devs) // tp, devs)
            for r in reshard_rank_sets(initial, grown) + reshard_rank_sets(grown, initial):
                out.setdefault(r, None)
    return list(out)
