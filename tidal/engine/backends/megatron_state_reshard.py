"""Resharding a Megatron actor's full state (weights + DistributedOptimizer state) with Tidal's planner rules.

What a rank of a megatron-core actor holds (tp, dp layout; tidal/engine/backends/megatron_stack.py builds it):

    model params   the TP-local GPTModel tensors (fused QKV, `[gate_t; up_t]` fc1, padded vocab), replicated over DP
    optimizer      DistributedOptimizer: each DP rank owns a contiguous range of every bucket of the DDP flat grad
                   buffer; seen per parameter, that is a contiguous flat sub-range [lo, hi) of the row-major
                   TP-local tensor, or nothing. For it the rank holds the fp32 main param, exp_avg, exp_avg_sq of
                   that range (torch AdamW state), and the step.

The ranges are megatron-core's, not ours: they follow its buffer layout (parameters in reverse order, starts padded
to 64 elements, buckets padded to a multiple of the DP size, one bucket per dtype when grads are not overlapped),
so a parameter may be split over DP ranks anywhere, or owned whole by one rank. Rather than re-deriving that
layout (it changes between megatron-core releases), every rank reads its own ranges from the live optimizer
(`_get_model_param_range_map`) and the ranks all-gather them (`gather_ranges`: one int64 tensor, no pickling).
The planner then uses **explicit per-rank flat ranges** where layout.py's ZeRO rule computes
`split(numel, dp, d)`: the second flat-range rule. Everything else is the native planner's region arithmetic
(tidal/engine/reshard/plan.py): a flat range of a TP-local tensor is at most three boxes in global coordinates, a move
is the intersection of a source box and a destination box.

    plan_state(old, new, specs, old_ranges, new_ranges)   pure: param moves (from `plan_reshard`, TP shards) and
                                                          optim moves (explicit ranges), cover-checked
    execute_state(plan, old_views, new_views, rank)       batched P2P on the world group: "param" in the compute
                                                          dtype, "optim" as one fp32 message of 3 x numel
                                                          (main, exp_avg, exp_avg_sq: same ownership)

`StateViews` is what a rank exposes for this: per spec, the TP-local param tensor and (lo, hi, main, exp_avg,
exp_avg_sq) as 1-D fp32 views of the owned range. The fused fc1 is two specs (`#gate`, `#up`, as in
megatron_reshard.py); its owned range on the fused tensor is cut at the half. Step and data cursor are scalars
the same on every rank, so they need no move. Moves copy bytes, so a reshard is exact: every element of every
tensor arrives bit for bit (tests/test_megatron_backend.py compares global states).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import cast

import torch
import torch.distributed as dist

from tidal.engine.layout import Layout, ParamSpec
from tidal.engine.reshard import Move, ReshardPlan, plan_reshard
from tidal.engine.reshard.plan import flat_boxes, intersect, shard_box, source_ts

OptView = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]  # lo, hi, main, exp_avg, exp_avg_sq
Ranges = tuple[tuple[int, int], ...]   # per spec: owned flat range [lo, hi) of the TP-local tensor (lo == hi: none)


@dataclass
class StateViews:
    """One rank's state, per spec (see module doc); `opt[i]` is None when the rank owns nothing of spec i."""

    specs: tuple[ParamSpec, ...]
    tp: int
    t: int
    params: list[torch.Tensor]
    opt: list[OptView | None]

    def ranges(self) -> Ranges:
        return tuple((o[0], o[1]) if o is not None else (0, 0) for o in self.opt)


def split_unit_range(lo: int, hi: int, unit_numel: int, half: str) -> tuple[int, int]:
    """The part of a fused-fc1 range [lo, hi) that falls in half `half` ("" = the whole tensor), in that half's
    own flat coordinates."""
    if not half:
        return lo, hi
    n = unit_numel // 2
    base = 0 if half == "gate" else n
    a, b = max(lo, base), min(hi, base + n)
    return (a - base, b - base) if b > a else (0, 0)


def gather_ranges(mine: Ranges | None, n_specs: int, device, group=None) -> dict[int, Ranges]:
    """All-gather every rank's ranges over `group` (None: the world), keyed by world rank (ranks outside the
    layout send None -> omitted)."""
    t = torch.full((n_specs, 2), -1, dtype=torch.int64, device=device)
    if mine is not None:
        t.copy_(torch.tensor(mine, dtype=torch.int64).reshape(n_specs, 2))
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    parts = [torch.empty_like(t) for _ in ranks]
    dist.all_gather(parts, t, group=group)
    out = {}
    for r, p in zip(ranks, parts):
        if int(p[0, 0]) >= 0:
            out[r] = tuple((int(a), int(b)) for a, b in p.tolist())
    return out


def _opt_boxes(spec: ParamSpec, lay: Layout, rank: int, ranges: dict[int, Ranges], i: int):
    t, _ = cast("tuple[int, int]", lay.coord(rank))  # a rank of `lay`
    lo, hi = ranges[rank][i]
    return flat_boxes(spec, lay.tp, t, lo, hi)


def plan_state(old: Layout, new: Layout, specs: tuple[ParamSpec, ...], old_ranges: dict[int, Ranges],
               new_ranges: dict[int, Ranges]) -> ReshardPlan:
    """Param moves by the native rule (TP shards, any DP replica); optim moves from the explicit ranges."""
    for lay, ranges, which in ((old, old_ranges, "old"), (new, new_ranges, "new")):
        missing = [r for r in lay.devices if r not in ranges]
        assert not missing, f"{which} layout ranks {missing} sent no optimizer ranges"
    base = plan_reshard(old, new, specs)
    moves = [m for m in base.moves if m.what == "param"]
    for i, spec in enumerate(specs):
        for idx, dst in enumerate(new.devices):
            t_new = idx % new.tp
            for dst_box in _opt_boxes(spec, new, dst, new_ranges, i):
                for t in source_ts(spec, old, dst, t_new, dst_box):
                    for d in range(old.dp):
                        src = old.device(t, d)
                        for src_box in _opt_boxes(spec, old, src, old_ranges, i):
                            box = intersect(src_box, dst_box)
                            if box is not None:
                                moves.append(Move(i, "optim", src, dst, box))
    plan = ReshardPlan(old, new, specs, tuple(moves), base.meta)
    _check_cover(plan, new_ranges)
    return plan


def _check_cover(plan: ReshardPlan, new_ranges: dict[int, Ranges]) -> None:
    """Our invariant: every destination element is written exactly once per kind (DP owners do not overlap)."""
    got: dict[tuple[int, str, int], int] = {}
    for m in plan.moves:
        got[(m.spec, m.what, m.dst)] = got.get((m.spec, m.what, m.dst), 0) + m.numel
    new = plan.new
    for i, spec in enumerate(plan.specs):
        for idx, dst in enumerate(new.devices):
            lo, hi = new_ranges[dst][i]
            want = {"param": prod(spec.tp_shape(new.tp, idx % new.tp)), "optim": hi - lo}
            for what, n in want.items():
                assert got.get((i, what, dst), 0) == n, (spec.name, what, dst, got.get((i, what, dst)), n)


def _local_slices(spec: ParamSpec, tp: int, t: int, box) -> tuple[slice, ...]:
    origin = shard_box(spec, tp, t)
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _opt_region(views: StateViews, i: int, box) -> list[torch.Tensor]:
    """Strided views of (main, exp_avg, exp_avg_sq) covering `box` inside the owned range of spec i."""
    spec = views.specs[i]
    lo, hi, *bufs = cast(OptView, views.opt[i])  # called for the ranges the rank owns
    local = spec.tp_shape(views.tp, views.t)
    sl = _local_slices(spec, views.tp, views.t, box)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    if len(local) == 1:
        start, size, stride = sl[0].start, (sl[0].stop - sl[0].start,), (1,)
    else:
        cols = local[1]
        start = sl[0].start * cols + sl[1].start
        size, stride = (sl[0].stop - sl[0].start, sl[1].stop - sl[1].start), (cols, 1)
    assert lo <= start and start + sum((n - 1) * s for n, s in zip(size, stride)) < hi, (spec.name, box, lo, hi)
    return [b.as_strided(size, stride, b.storage_offset() + start - lo) for b in bufs]


@torch.no_grad()
def execute_state(plan: ReshardPlan, old: StateViews | None, new: StateViews | None, rank: int,
                  param_dtype: torch.dtype, device) -> tuple[int, int]:
    """Run this rank's part of `plan` (sends from `old`, receives into `new`); returns (bytes sent, received).
    Both sides walk the plan in the same order, so per-pair message order matches without a handshake."""
    # this rank sends only from `old` and receives only into `new`: each is there where the plan uses it
    old, new = cast(StateViews, old), cast(StateViews, new)
    ops: list[dist.P2POp] = []
    unpack: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    sent = received = 0
    for mv in plan.moves:
        if rank not in (mv.src, mv.dst):
            continue
        spec = plan.specs[mv.spec]
        shape = [hi - lo for lo, hi in mv.box]
        if mv.what == "param":
            src = old.params[mv.spec][_local_slices(spec, old.tp, old.t, mv.box)] if mv.src == rank else None
            dst = new.params[mv.spec][_local_slices(spec, new.tp, new.t, mv.box)] if mv.dst == rank else None
            if src is not None and dst is not None:
                dst.copy_(src)
            elif src is not None:
                buf = src.contiguous()
                ops.append(dist.P2POp(dist.isend, buf, mv.dst))
                sent += buf.numel() * buf.element_size()
            else:
                buf = torch.empty(shape, dtype=param_dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, buf, mv.src))
                unpack.append(([cast(torch.Tensor, dst)], [buf]))  # receiving: dst is this rank's
                received += buf.numel() * buf.element_size()
            continue
        src_opt = _opt_region(old, mv.spec, mv.box) if mv.src == rank else None
        dst_opt = _opt_region(new, mv.spec, mv.box) if mv.dst == rank else None
        if src_opt is not None and dst_opt is not None:
            for a, b in zip(dst_opt, src_opt):
                a.copy_(b)
        elif src_opt is not None:
            buf = torch.stack([s.float() for s in src_opt])
            ops.append(dist.P2POp(dist.isend, buf, mv.dst))
            sent += buf.numel() * 4
        else:
            buf = torch.empty([3, *shape], dtype=torch.float32, device=device)
            ops.append(dist.P2POp(dist.irecv, buf, mv.src))
            unpack.append((cast(list[torch.Tensor], dst_opt), list(buf.unbind(0))))
            received += buf.numel() * 4
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    for dsts, bufs in unpack:
        for a, b in zip(dsts, bufs):
            a.copy_(b)
    return sent, received


__all__ = ["Ranges", "StateViews", "split_unit_range", "gather_ranges", "plan_state", "execute_state"]
