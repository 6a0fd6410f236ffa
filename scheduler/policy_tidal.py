"""`tidal` (the default): move devices only when a cost model predicts the move pays for itself.

Each decision compares a few candidate plans by their predicted end of step and picks the earliest; the
current plan ("do nothing") is always a candidate, so a move must beat it by more than its own cost
(reshard, migration re-prefill, release) plus a margin. A candidate is "release the j least-loaded rollout
instances (drained ones first, not the lowest ids), migrate their groups to the survivors, and run the actor on
all devices that are then free (any dp)".

Prediction, per candidate (t = 0 is now)::

    rollout end  T_r = max(all remaining tokens / survivors' rate at the consolidated batch,
                           slowest survivor's own remaining time) + re-prefill of what moved
    mini-batch j ready  ~ linear in groups still to generate over [0, T_r], plus scoring lag
    actor        t = reshard(now -> new); for each iter j left: t = max(t, ready_j) + iter_time(dp);
                 iters that start after T_r run on every device (the actor grows then; one more reshard)
    end          t + reshard back to the initial layout (the next step's rollout needs its devices)

Between boundaries (an instance drained, the actor waits for data) the policy also rebalances: the most
loaded instance hands groups to the least loaded when the predicted cut of its remaining time exceeds the
re-prefill cost (RLinf gives each instance one fixed slice and never moves work between survivors).

Cost: one sort of the instances plus O(instances) per candidate and O(log instances) candidates: well under
1 ms at 1,024 devices (benchmarks/scheduler.py measures it).
"""

from __future__ import annotations

import math

from tidal.scheduler.actions import (Action, LendToRollout, MigrateRequests, ReleaseInference, ReleaseRollout,
                                     ReshardActor, ReturnFromRollout)
from tidal.scheduler.signals import ActorLayout, RolloutInstanceSignal, Signals
from tidal.scheduler.state import SchedState

#: a move must beat doing nothing by this much (seconds) on top of its modelled cost: churn guard
MARGIN_S = 0.25
#: rebalance only when the heaviest instance's remaining time exceeds the lightest's by this factor
REBALANCE_RATIO = 1.5


def _instance_s(r: RolloutInstanceSignal) -> float:
    return r.est_remaining_s if not r.drained else 0.0


def _predict_end(state: SchedState, sig: Signals, totals: tuple[float, int], n_survivors: int,
                 slowest_s: float, moved_tokens: float, actor_size: int, full_size: int,
                 extra_cost: float) -> float:
    """Predicted seconds from now to the end of the step (see the module docstring)."""
    p, c = state.params, state.costs
    layout = sig.actor.layout
    remaining, running = totals
    if remaining > 0 and n_survivors:
        per = min(p.max_running_requests, running / n_survivors)
        rate = n_survivors * c.decode.rate(max(per, 1.0))
        t_r = max(remaining / rate, slowest_s)
        t_r += c.migration_time(moved_tokens / n_survivors) if moved_tokens else 0.0
    elif remaining > 0:
        return math.inf
    else:
        t_r = 0.0
    resp = state.mean_response_tokens or 1.0
    seq_tokens = state.prompt_tokens + resp
    lag = c.inference.group_time(p.group_size * seq_tokens, p.inference_tp)
    left = sig.groups_total - sig.groups_generated
    have = sig.inference.groups_finished
    tp = layout.tp
    iter_tokens = p.sequences_per_iter * seq_tokens

    t = extra_cost + c.reshard.grow_time(layout.size, actor_size, tp)
    size = actor_size
    first = sig.actor.iters_done
    for j in range(first, p.n_minibatches):
        need = (j + 1) * p.groups_per_iter
        if need <= have:
            ready = 0.0
        else:
            frac = 1.0 if left <= 0 else min(1.0, max(0.0, (need - sig.groups_generated) / left))
            ready = t_r * frac + lag
        start = max(t, ready)
        if j > first and size < full_size and start >= t_r + lag:  # grows at a later boundary
            start += c.reshard.grow_time(size, full_size, tp)
            size = full_size
        t = start + c.actor.iter_time(iter_tokens, tp, size // tp)
    init = p.initial_layout
    t += c.reshard.grow_time(size, init.size, tp)
    return t


def _layout_for(layout: ActorLayout, pool: list[int], size: int) -> ActorLayout:
    """Grow `layout` to `size` devices taking the lowest ids of `pool` (free devices, actor's excluded)."""
    new = tuple(sorted(layout.devices + tuple(pool[:size - layout.size])))
    return ActorLayout(layout.tp, size // layout.tp, new)


def _rebalance(state: SchedState, sig: Signals, live: list[RolloutInstanceSignal]) -> list[Action]:
    """Pair the heaviest instances with the lightest; move groups where the cut exceeds re-prefill cost."""
    c = state.costs
    if len(live) < 2:
        return []
    order = sorted(live, key=_instance_s)
    acts: list[Action] = []
    lo, hi = 0, len(order) - 1
    while lo < hi:
        light, heavy = order[lo], order[hi]
        th, tl = _instance_s(heavy), _instance_s(light)
        if th <= REBALANCE_RATIO * tl + MARGIN_S or heavy.groups_unfinished < 2 or th == math.inf:
            break
        per_group = heavy.est_remaining_tokens / heavy.groups_unfinished
        count = int(heavy.groups_unfinished * (th - tl) / (2 * th))
        count = min(count, heavy.groups_unfinished - 1)
        moved_progress = heavy.progress_tokens * count / max(heavy.groups_unfinished, 1)
        cost = c.migration_time(moved_progress + count * state.params.group_size * state.prompt_tokens)
        gain = (th - tl) / 2
        if count >= 1 and gain > cost + MARGIN_S:
            acts.append(MigrateRequests(
                f"rebalance: instance {heavy.id} ~{th:.1f}s left vs {light.id} ~{tl:.1f}s; "
                f"{count} groups (~{per_group * count:.0f} tokens), gain {gain:.1f}s > cost {cost:.2f}s",
                src=heavy.id, dst=light.id, count=count))
        lo, hi = lo + 1, hi - 1
    return acts


def _lend(state: SchedState, sig: Signals) -> list[Action]:
    """Step start: the actor has nothing to train until its first mini-batch is scored. Lend its devices to
    rollout when the predicted rollout time they save exceeds lend + return + re-prefill of what they hold."""
    p, c = state.params, state.costs
    devs = sig.actor.layout.devices
    lend = len(devs) // p.rollout_tp
    r = len(sig.rollout)
    if not lend or not r:
        return []
    mean = state.mean_response_tokens or 1.0
    seqs = sig.groups_total * p.group_size
    rate = c.decode.rate(min(p.max_running_requests, seqs / (r + lend)))
    first = seqs * mean / p.n_minibatches / (r * rate)           # until the first mini-batch, not lending
    held = min(p.max_running_requests, seqs / (r + lend)) * lend  # sequences the lent instances hold then
    cost = c.lend_s + c.return_s + c.migration_time(held * (state.prompt_tokens + mean / 2) / r)
    gain = first * lend / (r + lend)
    if gain <= cost + MARGIN_S:
        return []
    ids = tuple(devs[k * p.rollout_tp] for k in range(lend))
    return [LendToRollout(f"actor idle until its first mini-batch (~{first:.0f}s): lending saves ~{gain:.0f}s of "
                          f"rollout for ~{cost:.1f}s of lend/return/re-prefill", devices=devs[:lend * p.rollout_tp],
                          instance_ids=ids)]


def _return(state: SchedState, sig: Signals) -> list[Action]:
    """The first mini-batch is scored: lent instances hand their groups to the least-loaded survivors."""
    lent = [r for r in sig.rollout if r.lent]
    survivors = [r for r in sig.rollout if not r.lent]
    why = "the actor's first mini-batch is scored: lent devices go back"
    acts = _release_plan(sig, lent, survivors, why)
    rel = acts.pop()
    assert isinstance(rel, ReleaseRollout)
    return [*acts, ReturnFromRollout(why, rel.instance_ids, rel.devices, rel.migrate_to)]


def _release_plan(sig: Signals, gone: list[RolloutInstanceSignal], survivors: list[RolloutInstanceSignal],
                  why: str) -> list[Action]:
    """Migrate `gone`'s groups to the survivors with the least predicted remaining time, then release."""
    acts: list[Action] = []
    loads = sorted(((_instance_s(s), s.id) for s in survivors))
    k = 0
    for g in gone:
        if not g.groups_unfinished:
            continue
        per = g.est_remaining_s / g.groups_unfinished if g.groups_unfinished else 0.0
        left = g.groups_unfinished
        share = max(1, math.ceil(left / 4))  # each leaving instance feeds at most 4 survivors (few actions)
        while left:
            load, dst = loads[k % len(loads)]
            n = min(share, left)
            acts.append(MigrateRequests(why, src=g.id, dst=dst, count=n))
            loads[k % len(loads)] = (load + per * n, dst)
            left -= n
            k += 1
    acts.append(ReleaseRollout(why, tuple(g.id for g in gone), tuple(d for g in gone for d in g.devices),
                               migrate_to=tuple(sorted({a.dst for a in acts if isinstance(a, MigrateRequests)}))))
    return acts


def decide(state: SchedState, sig: Signals, now: float) -> list[Action]:
    p = state.params
    layout = sig.actor.layout
    live = sorted(sig.rollout, key=lambda r: (_instance_s(r), r.id))
    if sig.trigger == "start":
        return _lend(state, sig)
    if sig.actor.lent_out:
        if sig.inference.groups_finished >= p.groups_per_iter or sig.running == 0:
            return _return(state, sig)
        return _rebalance(state, sig, [r for r in live if not r.lent])
    if not sig.actor.at_boundary:
        return _rebalance(state, sig, [r for r in live if not r.lent])
    if sig.actor.iters_done >= p.n_minibatches:
        if layout != p.initial_layout:
            return [ReshardActor("step end: actor returns to its initial layout", layout, p.initial_layout)]
        return []

    acts: list[Action] = []
    free = sorted(sig.devices.free)
    if sig.inference.done and sig.inference.devices:
        acts.append(ReleaseInference("inference scored every group of the step", sig.inference.devices))
        free = sorted(free + list(sig.inference.devices))
    tp = layout.tp
    top = min(p.num_devices // tp, p.sequences_per_iter) * tp   # tidal sizes: every multiple of tp up to top
    # every device the actor can have once rollout and inference are done (it grows then)
    all_dev = layout.size + len(free) + sum(len(r.devices) for r in live)
    if not sig.inference.done:
        all_dev += len(sig.inference.devices)

    def fit(n_dev: int) -> int:
        return max(tp, min(top, n_dev // tp * tp))

    full = fit(all_dev)

    # candidates: j least-loaded instances go (j on a doubling grid, plus "all drained")
    drained = sum(1 for r in live if r.drained)
    js = {0, drained, len(live)}
    j = 1
    while j < len(live):
        js.add(j)
        j *= 2
    totals = (sum(r.est_remaining_tokens for r in live), sum(r.running for r in live))
    # live is sorted by remaining time: prefix sums give each candidate in O(1)
    moved_prefix, dev_prefix = [0.0], [0]
    for r in live:
        moved_prefix.append(moved_prefix[-1] + r.progress_tokens + r.running * state.prompt_tokens)
        dev_prefix.append(dev_prefix[-1] + len(r.devices))
    slowest = _instance_s(live[-1]) if live else 0.0
    best = (_predict_end(state, sig, totals, len(live), slowest, 0.0, layout.size, full, 0.0), 0, layout.size)
    for j in sorted(js):
        if j and j == len(live) and sig.running:
            continue
        size = fit(layout.size + len(free) + dev_prefix[j])
        if size < layout.size:
            continue
        cost = state.costs.rollout_release_s if j else 0.0
        end = _predict_end(state, sig, totals, len(live) - j, slowest, moved_prefix[j], size, full, cost)
        if end + MARGIN_S < best[0]:
            best = (end, j, size)
    _, j, size = best
    if j:
        gone, survivors = live[:j], live[j:]
        why = (f"release the {j} least-loaded instances (predicted step end {best[0]:.1f}s from now); "
               f"actor to {size} devices")
        acts += _release_plan(sig, gone, survivors, why)
        free = sorted(free + [d for r in gone for d in r.devices])
        live = survivors
    if size > layout.size:
        pool = [d for d in free if d not in layout.devices]
        acts.append(ReshardActor(f"predicted gain over the remaining iters exceeds reshard cost; dp "
                                 f"{layout.dp} -> {size // tp}", layout, _layout_for(layout, pool, size)))
    if not j:
        acts += _rebalance(state, sig, [r for r in live if not r.lent])
    return acts
