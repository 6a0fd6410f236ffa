"""Process groups of actor layouts, created once per layout and cached.

`dist.new_group` is collective over the whole world: every world rank must create the same groups in the same
order, including ranks that are not members (they get a non-member handle and never use it). So `GroupCache.get`
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tidal.engine.layout import Layout
from tidal.errors import LayoutError


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
            for d in range(layout.dp):
                g = self._new(layout.tp_group(d))
                if coord is not None and coord[1] == d:
                    tp = g
            for t in range(layout.tp):
                g = self._new(layout.dp_group(t))
                if coord is not None and coord[0] == t:
                    dp = g
            g = self._new(layout.devices)
            if coord is not None:
                everyone = g
            self._groups[layout] = LayoutGroups(layout, rank, tp, dp, everyone)
        return self._groups[layout]


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
