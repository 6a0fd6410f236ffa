"""`tidal` (the default): move devices only when a cost model predicts the move pays for itself.

Each decision compares a few candidate plans by their predicted end of step and picks the earliest; the
current plan ("do nothing") is always a candidate, so a move must beat it by more than its own cost
(reshard, migration, release, lend) plus a margin. Candidates at an actor boundary:

- grow: release the j least-loaded rollout instances (drained ones first, not the lowest ids; j on a doubling
  grid), migrate their groups to the least-loaded survivors, run the actor on every device then free (any dp);
- shrink (mid-step lending): the actor waits for its next mini-batch while rollout is throughput-bound: it
  gives devices to rollout, keeping `s` of them (any dp; s = 0 lends them all, `LendToRollout`, and they come
  back when the mini-batch is scored); the heaviest instances hand queued groups to the new instances.

Prediction, per candidate (t = 0 is now)::

    rollout end  T_r = decode steps x step time, steps = max(tail, tokens / slots + min(tail, tokens / slots))
                       per instance after the moves (full slots, then the last wave drains; `SchedState.
                       decode_seconds`) + migration of what moved
    mini-batch j ready  the learned readiness curve over [0, T_r] from how far the rollout is (the larger of
                        the id prefix and the tokens generated), plus scoring lag; the next one no sooner than
                        its longest sequence once all its sequences run (`_timeline`)
    a lend              lasts until the next mini-batch is scored: it speeds up what the lent instances
                        generate until then, not that mini-batch once its sequences run (`_predict_end`)
    actor        t = reshard(now -> new); for each iter j left: t = max(t, ready_j) + iter_time(dp), a DP rank
                 training whole micro-batches (dp 3 of 8 micro-batches trains 3/8 per rank, not 1/3);
                 iters that start after T_r run on every device (the actor grows then; one more reshard)
    end          t + reshard back to the initial layout (the next step's rollout needs its devices)

Remaining tokens per instance come from the producer's length model (mean residual life E[L - x | L > x]).
Migration moves the KV cache when the engine can (`PolicyParams.kv_migration`: KV bytes / link bandwidth,
~100x cheaper than RLinf's re-prefill), else re-prefills.

Step start: the actor has nothing to train until its first mini-batch is scored; it lends its devices to
rollout when the predicted rollout time they save exceeds lend + return + migration (cost model, not a
fixed threshold), and takes them back when that mini-batch is generated (`scheduler.return_on_generated`, on: the
moves run while its last groups are scored; off: once it is scored). At that moment it may also release
instances and grow the actor (`scheduler.grow_on_return`, on: in the simulator it shortens RLinf's example
from 184.6 to 169.9 s per step and the CPU e2e workload from 19.04 to 18.88 s).
Between boundaries (an instance drained, the actor trains) it rebalances: the most loaded instance hands groups
to the least loaded when the predicted cut of its remaining time exceeds the migration cost (RLinf never moves
work between survivors).

Cost: everything is numpy over the instances' columns (`Signals.cols`) plus O(log instances) candidates of
O(n_minibatches) scalar work; Python loops run only over emitted actions. Well under 1 ms at 1,024 devices
(benchmarks/scheduling.py reports p50/p99).
"""

from __future__ import annotations

import math
from typing import NamedTuple, cast

import numpy as np

from scheduler.actions import (
    Action,
    LendInference,
    LendToRollout,
    MigrateBatch,
    ReleaseInference,
    ReleaseRollout,
    ReshardActor,
    ReturnFromRollout,
    ReturnToInference,
    StartRollout,
    Wait,
)
from scheduler.signals import ActorLayout, RolloutColumns, Signals
from scheduler.state import SchedState

# A move must beat doing nothing by `margin(state, base)` predicted seconds on top of its modelled cost: the churn
# guard, `scheduler.margin_s` + `scheduler.margin_frac` x the predicted time the move improves on. Relative, because
# the model's error grows with what it predicts: an absolute 0.1 s costs the simulated 4 s steps of the CPU e2e
# workload (costs fitted with a host core per device) 1.25x -> 1.16x static, while RLinf's example (300 s steps)
# reads the same with (0, 0.01) as with (0.1, 0) (docs/scheduler.md).

#: instances whose predicted remaining times differ by less than this are equally loaded (release: lowest id first)
TIE_S = 1.0
#: rebalance only when the heaviest instance's remaining time exceeds the lightest's by this factor
REBALANCE_RATIO = 1.5

def margin(state: SchedState, base_s: float) -> float:
    """What a move must win on top of its modelled cost: `margin_s` plus `margin_frac` of the predicted time it
    improves on (the model's error grows with the time it predicts)."""
    return state.params.margin_s + state.params.margin_frac * base_s


def move_cost(state: SchedState, tokens: float) -> float:
    """Seconds a target instance loses receiving sequences of `tokens` (prompt + generated)."""
    c = state.costs
    return c.kv_move_time(tokens) if state.params.kv_migration else c.migration_time(tokens)


def _batch(state: SchedState, why: str, src: np.ndarray, dst: np.ndarray, count: np.ndarray) -> list[Action]:
    """One `MigrateBatch` of the (src id, dst id, count) moves with count > 0 (none: no action)."""
    keep = count > 0
    if not keep.any():
        return []
    moves = tuple(zip(src[keep].tolist(), dst[keep].tolist(), count[keep].tolist()))
    return [MigrateBatch(why, moves, kv=state.params.kv_migration)]


def held_cost(state: SchedState, seqs: float, k: int, n: int) -> float:
    """Seconds a target loses when `k` of `n` instances holding a fair share of `seqs` sequences (at most a
    slots' worth each, half generated) hand them to the other n - k (a lend's return, a release)."""
    p = state.params
    held = min(p.max_running_requests, seqs / n) * k
    return move_cost(state, held * (state.prompt_tokens + (state.mean_response_tokens or 1.0) / 2) / max(1, n - k))


def _by_load(cols: RolloutColumns, idx: np.ndarray, load: np.ndarray) -> np.ndarray:
    """`idx` ordered by `load` ascending, ties by instance id."""
    idx = idx[np.argsort(cols.id[idx], kind="stable")]
    return idx[np.argsort(load[idx], kind="stable")]


def inst_seconds(state: SchedState, cols: RolloutColumns) -> np.ndarray:
    """Predicted seconds each instance needs for its work. Every decode step costs `step_s + per_seq_s * b`
    and yields b tokens, so an instance needs `steps * step_s + tokens * per_seq_s` with steps = max(longest
    remaining sequence, tokens / slots). Without a tail estimate from the producer: tokens / current rate."""
    rem = cols.est_remaining_tokens
    out = np.where(cols.est_tail_tokens > 0, state.decode_seconds(rem, cols.est_tail_tokens), cols.est_remaining_s)
    return np.where((cols.running == 0) | (rem <= 0), 0.0, out)


def rollout_seconds(state: SchedState, remaining: float, tail: float, n_inst: int) -> float:
    """Rollout time of `remaining` tokens spread evenly over `n_inst` instances, longest sequence `tail`."""
    return float(state.decode_seconds(remaining / n_inst, tail))


class Timeline(NamedTuple):
    """What every candidate of one decision shares (`_timeline`)."""

    lag: float      #: scoring lag of one group
    #: per remaining iter j: (j, fraction of the rollout time left until its mini-batch is generated: -1 when it is
    #: scored, None when generated and being scored; its tokens)
    iters: list[tuple[int, float | None, float]]
    #: seconds until the next mini-batch is generated at the earliest: when all its sequences run, their longest
    #: remaining one (0 when some have not started)
    first_floor: float
    #: sequences of the next mini-batch (and earlier ones) not generated yet, at most all that is still running
    first_unfinished: int
    first_started: bool   #: every sequence of the next mini-batch has started (more instances cannot help it)


def _timeline(state: SchedState, sig: Signals) -> Timeline:
    """Per remaining iter j, when its mini-batch is generated as a fraction of the rollout time left, from the
    learned readiness curve: how far the rollout is (`f_now`) is the larger of the curve at the generated id
    prefix and the fraction of the step's tokens generated. The prefix alone stalls while one early group runs
    its tail: with half the step generated and group 0 still running, the prefix reads the rollout as not
    started and puts the first mini-batch ~1.5 s away when it is 0.36 s away (CPU e2e workload, a host core per
    device). Computed once per decision."""
    p, c = state.params, state.costs
    mean = state.mean_response_tokens or 1.0
    seq_tokens = state.prompt_tokens + mean
    lag = c.inference.group_time(p.group_size * seq_tokens, p.inference_tp)
    have = sig.inference.groups_finished
    step_tokens = p.sequences_per_iter * p.n_minibatches * seq_tokens
    total = max(sig.groups_total, 1)
    cols = sig.cols
    remaining = float(cols.est_remaining_tokens.sum()) if cols.id.size else 0.0
    done = 1.0 - remaining / (total * p.group_size * mean)
    f_now = min(1.0, max(state.time_fraction(sig.groups_generated / total), done, 0.0))
    out = []
    for j in range(sig.actor.iters_done, p.n_minibatches):
        need = (j + 1) * p.groups_per_iter
        if need <= have:
            frac = -1.0   # scored already: ready now
        elif need <= sig.groups_generated or f_now >= 1.0:
            frac = None   # generated, being scored
        else:   # the learned readiness curve, rescaled to the rollout time left (0: due now, by the curve)
            frac = max(0.0, (state.time_fraction(need / total) - f_now) / (1.0 - f_now))
        out.append((j, frac, step_tokens * state.iter_share(j)))
    # groups are dealt in id order and slots refill as sequences end, so beyond the generated prefix a slots'
    # worth per instance has started
    running = int(cols.running.sum()) if cols.id.size else 0
    unfinished = max(0, min(running, (sig.actor.iters_done + 1) * p.sequences_per_iter
                            - sig.groups_generated * p.group_size))
    first_started = unfinished <= int(cols.id.size) * p.max_running_requests
    floor = c.decode.step_s * sig.started_tail_tokens * state.rollout_time_factor if first_started else 0.0
    return Timeline(lag, out, floor, unfinished, first_started)


def _predict_end(state: SchedState, sig: Signals, remaining: float, tail: float, n_inst: int,
                 slowest_s: float, moved_tokens: float, actor_size: int, full_size: int, extra_cost: float,
                 lent_until_ready: bool = False, timeline: Timeline | None = None, back_inst: int = 0,
                 first_delay: float = 0.0, pause_s: float = 0.0, return_moves_s: float = 0.0) -> float:
    """Predicted seconds from now to the end of the step (see the module docstring).

    `extra_cost` delays the actor (the driver applies the moves first); `pause_s` delays the rollout (every
    instance pauses for a migration wave now); `first_delay` delays the next mini-batch only (its sequences wait
    a wave for slots). A lend (`lent_until_ready`, `back_inst` instances without the lent ones) is worth only
    what the lent instances generate until the next mini-batch is ready: they leave then (`return_s` and
    `return_moves_s`, the wave that hands their work back, before the actor starts), and the rest of the rollout
    runs on `back_inst` instances. When that mini-batch's sequences have all started (`Timeline.first_started`),
    the lent instances take none of them (they get queued groups: later ids), so it is ready when it would have
    been without them, and never before its longest sequence ends (`Timeline.first_floor`)."""
    p, c = state.params, state.costs
    layout = sig.actor.layout
    if remaining > 0 and n_inst:
        t_r = rollout_seconds(state, remaining, tail, n_inst)
        if not p.kv_migration:   # running sequences stay put (moving them re-prefills): the slowest bounds
            t_r = max(t_r, slowest_s)
        t_r += move_cost(state, moved_tokens / n_inst) if moved_tokens else 0.0
    elif remaining > 0:
        return math.inf
    else:
        t_r = 0.0
    tl = timeline or _timeline(state, sig)
    lag, iters = tl.lag, tl.iters
    tp = layout.tp
    t = extra_cost + (0.0 if lent_until_ready else c.reshard.grow_time(layout.size, actor_size, tp))
    size = actor_size
    first = sig.actor.iters_done
    for j, frac, tokens in iters:
        ready = 0.0 if frac is not None and frac < 0 else lag if frac is None else pause_s + t_r * frac + lag
        if j == first and frac is not None and frac >= 0:
            gen = max(t_r * frac, tl.first_floor)
            if lent_until_ready and back_inst and frac < 1:
                t_back = rollout_seconds(state, remaining, tail, back_inst)
                gen = max((t_back if tl.first_started else t_r) * frac, tl.first_floor)
                if gen < t_r:   # the lent instances did gen / t_r of the rollout; the rest runs without them
                    t_r = gen + (1.0 - gen / t_r) * t_back
            ready = pause_s + gen + lag + first_delay
        start = max(t, ready)
        if lent_until_ready and j == first:
            start = max(t, ready + c.return_s + return_moves_s)
        if j > first and size < full_size and start >= pause_s + t_r + lag:  # grows at a later boundary
            start += c.reshard.grow_time(size, full_size, tp)
            size = full_size
        t = start + c.actor.iter_time(tokens, tp, size // tp, p.micro_batches) * state.actor_time_factor
    t += c.reshard.grow_time(size, len(p.actor_devices), tp)
    return t


def _layout_for(layout: ActorLayout, pool: list[int], size: int) -> ActorLayout:
    """Grow `layout` to `size` devices taking the lowest ids of `pool` (free devices, actor's excluded)."""
    new = tuple(sorted(layout.devices + tuple(pool[:size - layout.size])))
    return ActorLayout(layout.tp, size // layout.tp, new)


def _spread(state: SchedState, why: str, cols: RolloutColumns, gone: np.ndarray, survivors: np.ndarray,
            srem: np.ndarray) -> list[Action]:
    """Migrate the unfinished groups of instances `gone` (positions in `cols`) to the survivors, least predicted
    remaining time first, round robin; each leaving instance feeds at most 4 survivors (few moves)."""
    g_un = cols.groups_unfinished
    src = gone[g_un[gone] > 0]
    if not src.size or not survivors.size:
        return []
    order = _by_load(cols, survivors, srem)
    left = g_un[src]
    share = -(-left // 4)
    nch = -(-left // share)
    rep = np.repeat(np.arange(src.size), nch)
    k = np.arange(rep.size)
    within = k - np.repeat(np.cumsum(nch) - nch, nch)
    size = np.where(within < nch[rep] - 1, share[rep], left[rep] - share[rep] * (nch[rep] - 1))
    return _batch(state, why, cols.id[src][rep], cols.id[order][k % order.size], size)


def _rebalance_gain(state: SchedState, cols: RolloutColumns, hi: np.ndarray, lo: np.ndarray, th: np.ndarray,
                    tl: np.ndarray, frac: np.ndarray) -> np.ndarray:
    """Seconds cut from the pair's finish time by moving `frac` of the heavy instance's remaining tokens to the
    light one: th - max(heavy after, light after). The moved groups may hold the heavy one's longest sequence,
    so the light one is charged that tail too: decode time per step does not shrink with fewer sequences, and
    moving a straggler only moves it (measured on the CPU e2e run: a 48-token tail group ping-ponged 8 times
    between instances, each move pausing it, when the gain was taken as half the load gap)."""
    rem_h, rem_l = cols.est_remaining_tokens[hi], cols.est_remaining_tokens[lo]
    tail_h, tail_l = cols.est_tail_tokens[hi], cols.est_tail_tokens[lo]
    moved = rem_h * frac
    after_h = state.decode_seconds(rem_h - moved, tail_h)
    after_l = state.decode_seconds(rem_l + moved, np.maximum(tail_l, tail_h))
    model = th - np.maximum(after_h, after_l)
    # without a tail estimate (a producer that reports rates only) the load gap is all there is
    return np.where(tail_h > 0, model, (th - tl) / 2)


def _rebalance(state: SchedState, sig: Signals, mask: np.ndarray) -> list[Action]:
    """Pair the heaviest instances with the lightest; move groups where the cut exceeds the migration cost."""
    cols = sig.cols
    idx = np.flatnonzero(mask)
    if idx.size < 2:
        return []
    srem = inst_seconds(state, cols)
    order = _by_load(cols, idx, srem)
    h = order.size // 2
    lo, hi = order[:h], order[::-1][:h]
    tl, th = srem[lo], srem[hi]
    g_un = cols.groups_unfinished[hi]
    ok = (th > REBALANCE_RATIO * tl + margin(state, th)) & (g_un >= 2) & np.isfinite(th)
    k = h if ok.all() else int(np.argmin(ok))
    if not k:
        return []
    lo, hi, tl, th, g_un = lo[:k], hi[:k], tl[:k], th[:k], g_un[:k]
    count = np.minimum((g_un * (th - tl) / (2 * th)).astype(np.int64), g_un - 1)
    moved = cols.progress_tokens[hi] * count / g_un + count * state.params.group_size * state.prompt_tokens
    p = state.params
    c = state.costs
    gain = _rebalance_gain(state, cols, hi, lo, th, tl, count / np.maximum(g_un, 1))
    if p.kv_migration:
        cost = c.kv_fixed_s + c.kv_bytes_per_token * moved / c.kv_bw
    else:
        cost = c.migration_fixed_s + c.decode.prefill_per_token_s * moved
    go = np.flatnonzero((count >= 1) & (gain > cost + margin(state, th)))
    if not go.size:
        return []
    i = go[0]
    why = (f"rebalance {go.size} pairs: heaviest ~{th[i]:.1f}s left vs ~{tl[i]:.1f}s, gain {gain[i]:.1f}s > "
           f"migration {cost[i]:.2f}s")
    return _batch(state, why, cols.id[hi[go]], cols.id[lo[go]], count[go])


def _fill(state: SchedState, why: str, cols: RolloutColumns, donors: np.ndarray, new_ids: list[int]) -> list[Action]:
    """New (empty) instances `new_ids` take groups from the most loaded `donors` (by remaining tokens) until
    every instance holds about the same share: the donors' surplus groups, laid end to end in token units,
    are cut into `len(new_ids)` equal pieces (water filling; one move per donor and piece)."""
    rem = cols.est_remaining_tokens
    g_un = cols.groups_unfinished
    target = float(rem[donors].sum()) / (donors.size + len(new_ids))
    order = donors[np.argsort(-rem[donors], kind="stable")]
    r, g = rem[order], g_un[order]
    ok = (r > target) & (g >= 2)
    n_ok = order.size if ok.all() else int(np.argmin(ok))
    order, r, g = order[:n_ok], r[:n_ok], g[:n_ok]
    if not n_ok:
        return []
    per = r / g
    surplus = np.minimum(g - 1, ((r - target) / per).astype(np.int64))
    rep = np.repeat(np.arange(n_ok), surplus)
    if not rep.size:
        return []
    tok = per[rep]
    center = np.cumsum(tok) - tok / 2
    piece = (center / target).astype(np.int64)
    keep = piece < len(new_ids)
    rep, piece = rep[keep], piece[keep]
    if not rep.size:
        return []
    key = rep * len(new_ids) + piece
    start = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    count = np.diff(np.concatenate([start, [key.size]]))
    dst = np.asarray(new_ids, dtype=np.int64)[piece[start]]
    return _batch(state, why, cols.id[order[rep[start]]], dst, count)


def _lend(state: SchedState, sig: Signals) -> list[Action]:
    """Step start: the actor has nothing to train until its first mini-batch is scored, and inference nothing
    to score until groups finish. Lend each one's devices to rollout when the predicted rollout time they save
    exceeds lend + return + migration of what they then hold (+ for inference, scoring what waited)."""
    p, c = state.params, state.costs
    r = len(sig.rollout)
    if not r:
        return []
    mean = state.mean_response_tokens or 1.0
    seqs = sig.groups_total * p.group_size
    acts: list[Action] = []
    devs = sig.actor.layout.devices
    la = len(devs) // p.rollout_tp
    inf = sig.inference.devices
    li = len(inf) // p.rollout_tp if p.inference_tp % p.rollout_tp == 0 or p.rollout_tp % p.inference_tp == 0 else 0
    li = li // max(1, p.inference_tp // p.rollout_tp) * max(1, p.inference_tp // p.rollout_tp)
    servers = max(1, len(inf) // p.inference_tp)
    score_s = c.inference.group_time(p.group_size * (state.prompt_tokens + mean), p.inference_tp)

    # no mini-batch is ready before its longest sequence is: decode steps do not get faster with fewer sequences,
    # so when that tail bounds the first mini-batch, more instances do not bring it sooner (measured on the CPU
    # e2e run: lending 4 more devices left rollout's end where static's was, and the actor lost its early iters)
    floor = c.decode.step_s * sig.tail_tokens * state.rollout_time_factor

    def first_s(n: int) -> float:
        """Time until the first mini-batch is generated with n instances: its share of the rollout, or the
        longest sequence's time, whichever is longer."""
        rate = c.decode.rate(min(p.max_running_requests, seqs / n))
        t_all = seqs * mean / (n * rate) * state.rollout_time_factor
        return max(floor, t_all * state.time_fraction(p.groups_per_iter / max(sig.groups_total, 1)))

    base = first_s(r)
    n = r
    if la and p.lend_actor:
        gain = base - first_s(r + la)
        cost = c.lend_s + c.return_s + held_cost(state, seqs, la, r + la)
        if gain > cost + margin(state, base):
            ids = tuple(devs[k * p.rollout_tp] for k in range(la))
            acts.append(LendToRollout(f"actor idle until its first mini-batch (~{base:.0f}s): lending saves "
                                      f"~{gain:.0f}s of rollout for ~{cost:.1f}s of lend/return/migration",
                                      devices=devs[:la * p.rollout_tp], instance_ids=ids))
            n = r + la
    if li:
        now_s = first_s(n)
        gain = now_s - first_s(n + li)
        # scoring restarts at the return: the groups generated by then wait (about one server's share)
        cost = c.lend_s + c.return_s + held_cost(state, seqs, li, n + li) + score_s * p.groups_per_iter / (4 * servers)
        if gain > cost + margin(state, now_s):
            lent = inf[:li * p.rollout_tp]
            ids = tuple(lent[k * p.rollout_tp] for k in range(li))
            acts.append(LendInference(f"inference idle until groups finish (~{now_s:.0f}s to the first "
                                      f"mini-batch): lending saves ~{gain:.0f}s for ~{cost:.1f}s",
                                      devices=lent, instance_ids=ids))
            acts.append(Wait("inference lent: decide its return by the scoring backlog", recheck_s=1.0))
    return acts


def _return_inference(state: SchedState, sig: Signals) -> list[Action]:
    """Inference devices are lent: take them back when scoring what has (and will have) arrived would
    otherwise delay the next mini-batch past its generation (or when rollout is done)."""
    p, c = state.params, state.costs
    cols = sig.cols
    lent_dev = sig.inference.lent
    on_inf = np.isin(cols.id, lent_dev)
    mean = state.mean_response_tokens or 1.0
    score_s = c.inference.group_time(p.group_size * (state.prompt_tokens + mean), p.inference_tp)
    servers = max(1, (len(sig.inference.devices) + len(lent_dev)) // p.inference_tp)
    need = (sig.actor.iters_done + 1) * p.groups_per_iter
    total = max(sig.groups_total, 1)
    remaining = float(cols.est_remaining_tokens.sum())
    running = int(cols.running.sum())
    tail = sig.tail_tokens if running else 0.0
    n = int(cols.running.size)
    t_r = rollout_seconds(state, remaining, max(tail, 1.0), n) if running else 0.0
    f_now = state.time_fraction(sig.groups_generated / total)
    if need <= sig.groups_generated or f_now >= 1.0:
        until = 0.0
    else:
        until = t_r * (state.time_fraction(need / total) - f_now) / (1.0 - f_now)
    # what waits to be scored, counted (not the id-order prefix of generated groups: with the prefix, 28 groups
    # waiting looked like 2 and inference came back after rollout, measured on the CPU e2e run)
    queued = sig.inference.groups_queued
    backlog = c.return_s + min(max(0, need - sig.inference.groups_finished), queued) * score_s / servers
    drain = c.return_s + queued * score_s / servers   # scoring everything waiting, once back
    if running and until > backlog + 1.0 and drain < t_r:
        return [Wait(f"inference lent: next mini-batch generated in ~{until:.0f}s, scoring backlog "
                     f"~{backlog:.1f}s (all waiting: ~{drain:.1f}s vs ~{t_r:.1f}s of rollout left)",
                     recheck_s=max(0.5, min(until - backlog, t_r - drain) / 2))]
    why = (f"scoring backlog ~{backlog:.1f}s vs ~{until:.0f}s to mini-batch {sig.actor.iters_done}, all waiting "
           f"~{drain:.1f}s vs ~{t_r:.1f}s of rollout left: inference back")
    srem = inst_seconds(state, cols)
    survivors = np.flatnonzero(~on_inf & ~cols.lent)
    if not survivors.size:
        survivors = np.flatnonzero(~on_inf)
    gone = np.flatnonzero(on_inf)
    acts = _spread(state, why, cols, gone, survivors, srem)
    acts.append(ReturnToInference(why, tuple(cols.id[gone].tolist()),
                                  sig.devices_of_many(gone.tolist()), _dsts(acts)))
    return acts


class _Candidate(NamedTuple):
    """One plan of `_plan`: its predicted end of step, what it does (j > 0: release the j least-loaded
    instances; j < 0: lend or start -j new instances on actor devices; 0: nothing) and the actor's size."""

    end: float
    j: int
    size: int


class _PlanInputs(NamedTuple):
    """What every candidate of one `_plan` decision reads (`_plan_inputs`); positions index `sig.cols`."""

    layout: ActorLayout
    free: list[int]             #: free device ids (inference's among them once it is released)
    srem: np.ndarray            #: predicted seconds each instance needs (`inst_seconds`)
    live: np.ndarray            #: positions of the instances not lent
    lent_idx: np.ndarray        #: positions of the lent instances
    order: np.ndarray           #: live positions, least loaded first
    n: int                      #: live instances
    top: int                    #: tidal sizes: every multiple of tp up to top
    full: int                   #: actor size on every device
    remaining: float            #: tokens left to generate
    running: int                #: sequences running
    tail: float                 #: tokens of the longest remaining sequence
    moved_prefix: np.ndarray    #: [j]: tokens (prompt + generated) the first j instances of `order` hold
    dev_prefix: np.ndarray      #: [j]: devices of the first j instances of `order`
    lent_moved: float           #: tokens the lent instances hold
    slowest: float              #: predicted seconds of the most loaded live instance
    extra: float                #: what delays the actor before any move (the return, when `returning`)
    tl: Timeline


def _fit(n_dev: int, tp: int, top: int) -> int:
    """The largest tidal actor size on `n_dev` devices (at least tp)."""
    return max(tp, min(top, n_dev // tp * tp))


def _plan(state: SchedState, sig: Signals, returning: bool) -> list[Action]:
    """An actor boundary (or, `returning`, its lent devices come back): pick the best grow/shrink candidate."""
    acts, free = _release_done_inference(sig)
    x = _plan_inputs(state, sig, returning, free)
    base = _predict_end(state, sig, x.remaining, x.tail, x.n, x.slowest, x.lent_moved, x.layout.size, x.full,
                        x.extra, timeline=x.tl)
    guard = margin(state, base)
    best = _best_grow(state, sig, x, returning, _Candidate(base, 0, x.layout.size), guard)
    best = _best_shrink(state, sig, x, returning, best, guard)
    moves, free = _return_and_release(state, sig, x, returning, best, base)
    return acts + moves + _resize_actor(state, sig, x, returning, best, base, free)


def _release_done_inference(sig: Signals) -> tuple[list[Action], list[int]]:
    """Release inference's devices once it has scored every group of the step; the free devices after."""
    free = sorted(sig.devices.free)
    if sig.inference.done and sig.inference.devices:
        return ([ReleaseInference("inference scored every group of the step", sig.inference.devices)],
                sorted(free + list(sig.inference.devices)))
    return [], free


def _plan_inputs(state: SchedState, sig: Signals, returning: bool, free: list[int]) -> _PlanInputs:
    """The loads, sizes and prefix sums every candidate of the decision shares."""
    p, c = state.params, state.costs
    layout = sig.actor.layout
    tp = layout.tp
    cols = sig.cols
    srem = inst_seconds(state, cols)
    lent = cols.lent
    live = np.flatnonzero(~lent)
    lent_idx = np.flatnonzero(lent)
    # least loaded first; loads within TIE_S of each other count as equal and go lowest id first, so the actor
    # tends to grow onto the same contiguous device sets step after step: a layout met before reshards among
    # its own devices only, with its process groups cached (a new one is world-wide: ~0.4 s vs ~0.05 s on CPU)
    order = live[np.lexsort((cols.id[live], np.floor(srem[live] / TIE_S)))]
    n = order.size
    top = min(p.num_devices // tp, p.sequences_per_iter) * tp   # tidal sizes: every multiple of tp up to top
    all_dev = layout.size + len(free) + int(cols.n_devices[live].sum())
    if not sig.inference.done:
        all_dev += len(sig.inference.devices)
    remaining = float(cols.est_remaining_tokens.sum())
    running = int(cols.running.sum())
    tail = sig.tail_tokens if cols.running.size else 0.0
    if tail <= 0 and running:   # no tail estimate from the producer: the mean residual (a lower bound)
        tail = remaining / running
    prompt = state.prompt_tokens
    tok = cols.progress_tokens + cols.running * prompt
    moved_prefix = np.concatenate([[0.0], np.cumsum(tok[order])])
    dev_prefix = np.concatenate([[0], np.cumsum(cols.n_devices[order])])
    lent_moved = float(tok[lent_idx].sum())
    slowest = float(srem[order[-1]]) if n else 0.0
    extra = c.return_s if returning else 0.0
    return _PlanInputs(layout, free, srem, live, lent_idx, order, n, top, _fit(all_dev, tp, top), remaining,
                       running, tail, moved_prefix, dev_prefix, lent_moved, slowest, extra, _timeline(state, sig))


def _grow_counts(state: SchedState, sig: Signals, x: _PlanInputs) -> list[int]:
    """Grow candidates: j least-loaded instances go (j on a doubling grid, plus "all drained", plus all)."""
    n = x.n
    drained = int(np.count_nonzero(sig.cols.running[x.order] == 0))
    js = {0, drained, n}
    j = 1
    while j < n:
        js.add(j)
        j *= 2
    # what is left fits one instance's slots: keep one, free the rest
    if 0 < x.running <= state.params.max_running_requests:
        js.add(n - 1)
    return sorted(js)


def _best_grow(state: SchedState, sig: Signals, x: _PlanInputs, returning: bool, best: _Candidate,
               guard: float) -> _Candidate:
    """`best` or a grow candidate beating it by `guard`: release the j least-loaded instances, migrate their
    groups to the survivors, and grow the actor onto their devices (and the free ones)."""
    p, c = state.params, state.costs
    layout, n, tl = x.layout, x.n, x.tl
    # when the instances left after a release cannot hold the next mini-batch's unfinished sequences
    # (`Timeline.first_unfinished`) in their slots, the rest waits for slots, about one more longest sequence.
    # Without this term a release at step start, while the first mini-batch (the first wave, exactly every
    # slot) runs, delays that mini-batch by ~0.7 s on the CPU e2e workload
    wave_s = c.decode.step_s * x.tail * state.rollout_time_factor
    for j in _grow_counts(state, sig, x):
        if not j or (j == n and x.running) or (returning and not p.grow_on_return):
            continue
        size = _fit(layout.size + len(x.free) + int(x.dev_prefix[j]), layout.tp, x.top)
        if size <= layout.size:
            continue
        cost = x.extra + c.rollout_release_s
        late = wave_s if tl.first_unfinished > (n - j) * p.max_running_requests else 0.0
        end = _predict_end(state, sig, x.remaining, x.tail, n - j, x.slowest, x.lent_moved + x.moved_prefix[j],
                           size, x.full, cost, timeline=tl, first_delay=late)
        if end + guard < best.end:
            best = _Candidate(end, j, size)
    return best


def _best_shrink(state: SchedState, sig: Signals, x: _PlanInputs, returning: bool, best: _Candidate,
                 guard: float) -> _Candidate:
    """`best` or a shrink candidate (mid-step lending) beating it by `guard`: only while the actor waits for
    data and rollout has work."""
    p, c = state.params, state.costs
    layout = x.layout
    tp = layout.tp
    n = x.n
    need = (sig.actor.iters_done + 1) * p.groups_per_iter
    # a lend speeds up generation: once the mini-batch is generated the actor waits only for its scores, and a
    # lend would come back at once (on the host e2e run, lent 1.117 s into a step, back 0.1 s later, after the
    # actor had taken its devices back on the mini-batch's generation: 0.2 s of moves for nothing)
    waiting = sig.groups_generated < need and not returning
    if not (p.lend_actor and waiting and x.running and n and p.rollout_tp <= layout.size):
        return best
    # a lend speeds up only what the lent instances generate until the next mini-batch is scored, and not
    # that mini-batch once its sequences all run (`_predict_end`). Priced as if the lent instances sped up the
    # whole rollout, a lend at every step's first boundary makes the first mini-batch 0.09-0.60 s *later* than
    # static's on the CPU e2e workload (1.21-1.53 s vs 0.93-1.17 s): it is the first wave there, and the moves
    # stall its instances
    for size in sorted({0, layout.size // 2 // tp * tp}):
        if size >= layout.size or 0 < size < p.min_actor_devices:
            continue
        new = (layout.size - size) // p.rollout_tp
        # the new instances are filled by one migration wave (every instance in it pauses); lent ones hand
        # what they hold back when the mini-batch is scored (another wave, before the actor can start)
        cost = c.lend_s + (c.reshard.grow_time(layout.size, size, tp) if size else 0.0)
        back_s = 0.0 if size else held_cost(state, x.running, new, n + new)
        end = _predict_end(state, sig, x.remaining, x.tail, n + new, x.slowest, 0.0, size or layout.size, x.full,
                           cost, lent_until_ready=not size, timeline=x.tl, back_inst=n,
                           pause_s=move_cost(state, 0.0), return_moves_s=back_s)
        if end + guard < best.end:
            best = _Candidate(end, -new, size)
    return best


def _return_and_release(state: SchedState, sig: Signals, x: _PlanInputs, returning: bool, best: _Candidate,
                        base: float) -> tuple[list[Action], list[int]]:
    """The lent instances' return (`returning`) and the release `best` chose, with their migrations; the free
    devices after the release."""
    cols = sig.cols
    end, j, size = best
    free = x.free
    acts: list[Action] = []
    back = []
    if returning:
        why = "the actor's first mini-batch is scored: lent devices go back"
        back = _spread(state, why, cols, x.lent_idx, x.order[j:], x.srem)
        ret = ReturnFromRollout(why, tuple(cols.id[x.lent_idx].tolist()), sig.devices_of_many(x.lent_idx.tolist()),
                                migrate_to=_dsts(back))
    if j > 0:
        gone, survivors = x.order[:j], x.order[j:]
        why = (f"release the {j} least-loaded instances (predicted step end {end:.1f}s from now vs "
               f"{base:.1f}s); actor to {size} devices")
        moves = _spread(state, why, cols, gone, survivors, x.srem)
        released = sig.devices_of_many(gone.tolist())
        rel = ReleaseRollout(why, tuple(cols.id[gone].tolist()), released, migrate_to=_dsts(moves))
        free = sorted(free + list(released))
        if back and moves:   # one batch for both: the lent and the released instances empty in the same waves
            b0, m0 = cast(MigrateBatch, back[0]), cast(MigrateBatch, moves[0])   # `_spread` makes MigrateBatches
            acts.append(MigrateBatch(f"{b0.reason}; {why}", b0.moves + m0.moves, kv=b0.kv))
            acts += [ret, rel]
        else:
            acts += back + ([ret] if returning else []) + moves + [rel]
    elif returning:
        acts += back + [ret]
    return acts, free


def _resize_actor(state: SchedState, sig: Signals, x: _PlanInputs, returning: bool, best: _Candidate,
                  base: float, free: list[int]) -> list[Action]:
    """The actor's side of `best`: grow onto the lowest free ids, give devices to rollout, or (nothing chosen
    at a boundary) rebalance the rollout."""
    layout = x.layout
    if best.size > layout.size:
        mine = set(layout.devices)
        pool = [d for d in free if d not in mine]
        return [ReshardActor(f"predicted gain over the remaining iters exceeds reshard cost; dp "
                             f"{layout.dp} -> {best.size // layout.tp}", layout, _layout_for(layout, pool, best.size))]
    if best.j < 0:
        return _give_to_rollout(state, sig, x, best, base)
    if not returning and best.j == 0:
        return _rebalance(state, sig, ~sig.cols.lent)
    return []


def _give_to_rollout(state: SchedState, sig: Signals, x: _PlanInputs, best: _Candidate,
                     base: float) -> list[Action]:
    """The actor keeps `best.size` devices (0: lends them all until the mini-batch is scored); the rest start
    rollout instances, filled from the most loaded live ones."""
    p = state.params
    layout, tp = x.layout, x.layout.tp
    end, size = best.end, best.size
    leaving = tuple(sorted(layout.devices)[size:])
    leaving = leaving[:len(leaving) // p.rollout_tp * p.rollout_tp]
    new_ids = [leaving[k] for k in range(0, len(leaving), p.rollout_tp)]
    why = (f"actor waits for mini-batch {sig.actor.iters_done} while rollout is throughput-bound: "
           f"{len(leaving)} devices to rollout (predicted step end {end:.1f}s vs {base:.1f}s)")
    acts: list[Action] = []
    if size:
        keep = tuple(sorted(layout.devices)[:size])
        acts.append(ReshardActor(why, layout, ActorLayout(tp, size // tp, keep)))
        acts.append(StartRollout(why, leaving, tuple(new_ids)))
    else:
        acts.append(LendToRollout(why, leaving, tuple(new_ids)))
    acts += _fill(state, why, sig.cols, x.live, new_ids)
    return acts


def _dsts(acts: list[Action]) -> tuple[int, ...]:
    dsts = [np.fromiter((m[1] for m in a.moves), np.int64, len(a.moves)) for a in acts if isinstance(a, MigrateBatch)]
    return tuple(np.unique(np.concatenate(dsts)).tolist()) if dsts else ()


def decide(state: SchedState, sig: Signals, now: float) -> list[Action]:
    p = state.params
    layout = sig.actor.layout
    if sig.trigger == "start":
        return _lend(state, sig)
    cols = sig.cols
    if sig.inference.lent:
        return _return_inference(state, sig)
    if sig.actor.lent_out:
        need = (sig.actor.iters_done + 1) * p.groups_per_iter
        # back once the mini-batch is generated, not scored: the moves (return, releases, reshard) run while its
        # last groups are scored. Waiting for the scores puts them in series: iter 0 then starts 0.12 s after
        # its mini-batch is scored, 0.25 s after static's (CPU e2e workload)
        if (p.return_on_generated and sig.groups_generated >= need) or sig.inference.groups_finished >= need \
                or sig.running == 0:
            return _plan(state, sig, returning=True)
        return _rebalance(state, sig, ~cols.lent)
    if not sig.actor.at_boundary:
        return _rebalance(state, sig, ~cols.lent)
    if sig.actor.iters_done >= p.n_minibatches:
        if layout != p.initial_layout:
            return [ReshardActor("step end: actor returns to its initial layout", layout, p.initial_layout)]
        return []
    return _plan(state, sig, returning=False)
