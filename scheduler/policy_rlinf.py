"""`rlinf`: RLinf's dynamic scheduling as its open code behaves (see /work/shared/RLINF_NOTES.md).

Decisions happen at actor iter boundaries (plus RLinf's 1 s pre-process poll), visiting rollout, then
inference, then actor, with a running count of free devices. Its flaws are kept on purpose, because this is
the baseline we measure against:

- count based: release is decided from `running` and `max_running_requests` only, the lowest instance ids
  go first whatever their load, and requests are spread `groups // survivors` with the remainder on the last;
- only sizes with whole groups per DP rank: free devices that cannot complete such a size stay idle;
- the actor never shrinks within a step, inference is released only all at once when done;
- pre-process hands the actor's devices back only when `running <= threshold x total tasks`, polled each 1 s,
  even if the actor's first mini-batch has long been ready.

It reads the rollout as columns (`Signals.cols`), so a decision at 1,024 devices has no Python loop per
instance except over the migrations it emits (RLinf's spread can emit hundreds; they stay individual
`MigrateRequests`, as RLinf sends them). Unlike RLinf, devices are named by id (the lowest free ids join the
actor: with the contiguous actor -> rollout -> inference placement these are the ones rollout just released next
to it), and each flag has one default (tidal/core/config.py), read once by `PolicyParams.from_config`.

Worked example (8 devices, actor 0-1 TP 2, rollout 2-5 TP 1, inference 6-7, max_running_requests 512, sizes
{2, 4, 8}): after iter 0 with 700 sequences running, 2 instances suffice, so 2 may go; size 4 needs 2 devices:
instances 2 and 3 are released (their groups spread over 4 and 5) and the actor reshards to devices 0-3.
"""

from __future__ import annotations

import math

import numpy as np

from scheduler.actions import (
    Action,
    LendToRollout,
    MigrateRequests,
    ReleaseInference,
    ReleaseRollout,
    ReshardActor,
    ReturnFromRollout,
    Wait,
)
from scheduler.signals import ActorLayout, Signals
from scheduler.state import PolicyParams, SchedState


def spread(src_ids: list[int], src_groups: list[int], survivor_ids: list[int], why: str) -> list[MigrateRequests]:
    """RLinf's spread: all unfinished groups of the sources, `total // len(survivors)` to each survivor in id
    order, the remainder to the last one."""
    if not survivor_ids:
        return []
    per_src = [(s, n) for s, n in zip(src_ids, src_groups) if n]
    total = sum(n for _, n in per_src)
    quota = [total // len(survivor_ids)] * len(survivor_ids)
    quota[-1] += total - sum(quota)
    out: list[MigrateRequests] = []
    si = 0
    for src, n in per_src:
        while n:
            while quota[si] == 0:
                si += 1
            take = min(n, quota[si])
            out.append(MigrateRequests(why, src=src, dst=survivor_ids[si], count=take))
            quota[si] -= take
            n -= take
    return out


def _largest_size(sizes: tuple[int, ...], current: int, extra: int) -> int:
    """Largest valid size reachable with `extra` more devices (current if none)."""
    best = current
    for s in sizes:
        if current < s <= current + extra:
            best = s
    return best


def _pre_process(p: PolicyParams, sig: Signals) -> list[Action]:
    cols = sig.cols
    total = sig.total_tasks
    running = sig.running
    if sig.all_registered and running <= p.pre_process_threshold * total:
        order = np.argsort(cols.id, kind="stable")
        lent = order[cols.lent[order]]
        survivors = order[~cols.lent[order]]
        why = (f"pre-process: running {running} <= {p.pre_process_threshold} x {total} tasks; "
               f"hand the actor's devices back")
        moves = spread(cols.id[lent].tolist(), cols.groups_unfinished[lent].tolist(), cols.id[survivors].tolist(), why)
        devices = sig.devices_of_many(lent.tolist())
        return [*moves, ReturnFromRollout(why, instance_ids=tuple(cols.id[lent].tolist()), devices=devices,
                                          migrate_to=tuple(sorted({m.dst for m in moves})))]
    return [Wait(f"pre-process: running {running} > {p.pre_process_threshold} x {total} tasks",
                 recheck_s=p.pre_process_check_s)]


def decide(state: SchedState, sig: Signals, now: float) -> list[Action]:
    p = state.params
    if sig.trigger == "start":
        return _lend_at_start(p, sig)
    if sig.cols.lent.any():  # polled every pre_process_check_s (the "tick" trigger) only
        return _pre_process(p, sig) if sig.trigger == "tick" else [Wait("pre-process: between polls")]
    if not sig.actor.at_boundary or not (sig.trigger == "boundary" or sig.actor.held):
        return []  # RLinf decides only when an iter finishes (or re-asks while holding the actor)

    n, k = p.n_minibatches, sig.actor.iters_done
    layout = sig.actor.layout
    if k >= n:  # step end: back to the initial layout so next step's rollout gets its devices
        if layout != p.initial_layout:
            return [ReshardActor("step end: actor returns to its initial layout", layout, p.initial_layout)]
        return []

    # RLinf's visit order (rollout, inference, actor) with a running count of free devices
    last_wait = p.use_wait_before_last_iter_policy and k == n - 1
    sizes = p.rlinf_sizes()
    acts, free, holding = _visit_rollout(p, sig, sizes, last_wait)
    inf_acts, freed, holding = _visit_inference(sig, last_wait, holding)
    acts += inf_acts
    free += freed
    if not holding:
        acts += _visit_actor(sig, sizes, free, acts)
    return acts


def _lend_at_start(p: PolicyParams, sig: Signals) -> list[Action]:
    """Step start (pre-process policy): the actor's devices run rollout instances."""
    if not p.use_pre_process_policy:
        return []
    devs = sig.actor.layout.devices
    ids = tuple(devs[k] for k in range(0, len(devs) - len(devs) % p.rollout_tp, p.rollout_tp))
    return [LendToRollout("pre-process: the actor's devices run rollout until the step's work thins out",
                          devices=devs[:len(ids) * p.rollout_tp], instance_ids=ids)]


def _visit_rollout(p: PolicyParams, sig: Signals, sizes: tuple[int, ...],
                   last_wait: bool) -> tuple[list[Action], int, bool]:
    """1. rollout: release every instance once it is done, or (count based) the lowest ids that the largest
    valid actor size can absorb; (actions, free devices after, whether the actor is held)."""
    cols = sig.cols
    layout = sig.actor.layout
    acts: list[Action] = []
    free = len(sig.devices.free)
    live = np.argsort(cols.id, kind="stable")   # positions in id order
    if not live.size:
        return acts, free, False
    running = sig.running
    if running == 0:
        acts.append(ReleaseRollout("rollout finished: running_tasks == 0", tuple(cols.id[live].tolist()),
                                   sig.devices_of_many(live.tolist())))
        free += int(cols.n_devices.sum())
    elif last_wait:
        acts.append(Wait(f"wait before last iter: {running} tasks still running"))
        return acts, free, True
    else:
        needed = math.ceil(running / p.max_running_requests)
        may_go = live.size - needed
        target = _largest_size(sizes, layout.size, free + may_go * p.rollout_tp)
        go = max(0, math.ceil((target - layout.size - free) / p.rollout_tp)) if target > layout.size else 0
        if go:
            gone, survivors = live[:go], live[go:]
            why = (f"running {running} fits in {needed} of {live.size} instances; actor size {target} "
                   f"absorbs {go} (lowest ids first)")
            moves = spread(cols.id[gone].tolist(), cols.groups_unfinished[gone].tolist(),
                           cols.id[survivors].tolist(), why)
            acts += moves
            acts.append(ReleaseRollout(why, tuple(cols.id[gone].tolist()), sig.devices_of_many(gone.tolist()),
                                       migrate_to=tuple(sorted({m.dst for m in moves}))))
            free += go * p.rollout_tp
    return acts, free, False


def _visit_inference(sig: Signals, last_wait: bool, holding: bool) -> tuple[list[Action], int, bool]:
    """2. inference: released only all at once when done; (actions, devices freed, whether the actor is held)."""
    inf = sig.inference
    if inf.devices:
        if inf.done:
            return [ReleaseInference("inference finished", inf.devices)], len(inf.devices), holding
        if last_wait and not holding:
            return [Wait("wait before last iter: inference not finished")], 0, True
    return [], 0, holding


def _visit_actor(sig: Signals, sizes: tuple[int, ...], free: int, acts: list[Action]) -> list[Action]:
    """3. actor: grow to the largest valid size the `free` devices reach, onto the lowest ids among the free
    ones and those `acts` release."""
    layout = sig.actor.layout
    target = _largest_size(sizes, layout.size, free)
    if target <= layout.size:
        return []
    released = [d for a in acts if isinstance(a, (ReleaseRollout, ReleaseInference)) for d in a.devices]
    pool = sorted(set(sig.devices.free) | set(released))
    new = tuple(sorted(layout.devices + tuple(pool[:target - layout.size])))
    return [ReshardActor(f"largest valid size with {free} free devices is {target}",
                         layout, ActorLayout(layout.tp, target // layout.tp, new))]
