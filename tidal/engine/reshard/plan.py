"""Reshard planning: pure region arithmetic from two layouts and the ParamSpec inventory.

Each rank's holdings of a parameter are boxes in global coordinates:
- param (compute weights): the TP shard box, on every DP replica;
- optim (master + moments): the flat range split(numel(TP shard), dp, d) of the row-major TP shard, which is at
  most 3 boxes (partial first row, full rows, partial last row); a 1-D parameter's range is one box.
A destination box is covered by intersecting it with the boxes of one source replica per TP shard: sources on
the destination's own device are preferred (a local copy), else replicas are spread by destination index.
Intersections of boxes are boxes, so every move is a box and a strided view on both sides.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

from tidal.engine.layout import Layout, ParamSpec
from tidal.engine.reshard.records import MetaMove, Move, ReshardPlan

Box = tuple[tuple[int, int], ...]


def shard_box(spec: ParamSpec, tp: int, t: int) -> Box:
    out = []
    for dim, n in enumerate(spec.shape):
        out.append(spec.tp_range(tp, t) if dim == spec.tp_dim else (0, n))
    return tuple(out)


def flat_boxes(spec: ParamSpec, tp: int, t: int, lo: int, hi: int) -> list[Box]:
    """Global boxes of the flat range [lo, hi) of TP shard t (row-major)."""
    if hi <= lo:
        return []
    origin = [b[0] for b in shard_box(spec, tp, t)]
    shape = spec.tp_shape(tp, t)
    assert len(shape) in (1, 2), f"{spec.name}: only 1-D and 2-D parameters are supported"
    if len(shape) == 1:
        return [((origin[0] + lo, origin[0] + hi),)]
    cols = shape[1]
    r0, c0 = divmod(lo, cols)
    r1, c1 = divmod(hi, cols)
    rects: list[tuple[int, int, int, int]] = []
    if r0 == r1:
        rects.append((r0, r0 + 1, c0, c1))
    else:
        if c0:
            rects.append((r0, r0 + 1, c0, cols))
            r0 += 1
        if r1 > r0:
            rects.append((r0, r1, 0, cols))
        if c1:
            rects.append((r1, r1 + 1, 0, c1))
    return [((origin[0] + a, origin[0] + b), (origin[1] + c, origin[1] + d)) for a, b, c, d in rects]


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def holdings(spec: ParamSpec, lay: Layout, t: int, d: int, what: str) -> list[Box]:
    if what == "param":
        return [shard_box(spec, lay.tp, t)]
    lo, hi = spec.zero_range(lay, t, d)
    return flat_boxes(spec, lay.tp, t, lo, hi)


def source_ts(spec: ParamSpec, old: Layout, dst: int, t_new: int, dst_box: Box) -> list[int]:
    """Old TP indices whose shards cover `dst_box`: one replica if the parameter is replicated over TP."""
    if spec.tp_dim is None:
        here = old.coord(dst)
        return [here[0] if here is not None else t_new % old.tp]
    return [t for t in range(old.tp) if intersect(shard_box(spec, old.tp, t), dst_box) is not None]


def plan_reshard(old: Layout, new: Layout, specs: tuple[ParamSpec, ...] | list[ParamSpec]) -> ReshardPlan:
    """The moves from layout `old` to `new` for parameters `specs`: pure, and the same value on every rank."""
    return _plan_cached(old, new, tuple(specs))


@lru_cache(maxsize=64)
def _plan_cached(old: Layout, new: Layout, specs: tuple[ParamSpec, ...]) -> ReshardPlan:
    moves: list[Move] = []
    for i, spec in enumerate(specs):
        for idx, dst in enumerate(new.devices):
            t_new, d_new = idx % new.tp, idx // new.tp
            here = old.coord(dst)
            for what in ("param", "optim"):
                for dst_box in holdings(spec, new, t_new, d_new, what):
                    for t in source_ts(spec, old, dst, t_new, dst_box):
                        if what == "param":  # any DP replica holds it: prefer our own device, else spread
                            d_src = here[1] if here is not None else idx % old.dp
                            sources = [d_src]
                        else:
                            sources = list(range(old.dp))
                        for d in sources:
                            for src_box in holdings(spec, old, t, d, what):
                                box = intersect(src_box, dst_box)
                                if box is not None:
                                    moves.append(Move(i, what, old.device(t, d), dst, box))
    meta = []
    for idx, dst in enumerate(new.devices):
        t, d = idx % new.tp, idx // new.tp
        if t < old.tp and d < old.dp:
            meta.append(MetaMove(dst, old.device(t, d), True))
        else:
            meta.append(MetaMove(dst, old.device(t % old.tp, d % old.dp), False))
    plan = ReshardPlan(old, new, specs, tuple(moves), tuple(meta))
    _check_cover(plan)
    return plan


def _check_cover(plan: ReshardPlan) -> None:
    """Our invariant: every destination element is written exactly once per kind."""
    need: dict[tuple[int, str, int], int] = {}
    for m in plan.moves:
        key = (m.spec, m.what, m.dst)
        need[key] = need.get(key, 0) + m.numel
    new = plan.new
    for i, spec in enumerate(plan.specs):
        for idx, dst in enumerate(new.devices):
            t, d = idx % new.tp, idx // new.tp
            for what in ("param", "optim"):
                want = sum(prod(hi - lo for lo, hi in b) for b in holdings(spec, new, t, d, what))
                assert need.get((i, what, dst), 0) == want, (spec.name, what, dst, need.get((i, what, dst)), want)
