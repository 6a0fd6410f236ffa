"""Rollout instances in the simulator: continuous batching in closed form, laid out for many instances at once.

Model. An instance runs at most M = max_running_requests sequences at once; every decode step advances each
running sequence by one token and takes `step_s + per_seq_s * b` with b sequences running. We measure
progress on a *token clock* T (decode steps since the epoch started) and keep the wall clock as a function
of it. Slots are lanes: sequence j of the epoch's queue runs on lane j mod M, after the earlier sequences of
that lane (an engine gives a freed slot to the next queued request; fixing the lane up front overstates the
tail slightly when an instance holds 1-4x its slots, and is exact up to M). Then, with lane totals u_l::

    wall(T) = t0 + step_s * T + per_seq_s * sum_l min(u_l, T)       (piecewise linear, breakpoints u_l)
    sequence j: starts at S_j (lane prefix), ends at F_j = S_j + len_j; a group ends at max F_j of its seqs

An *epoch* lasts until the instance's work changes (migration in or out); then the unfinished sequences are
re-laid from `now`: running ones first (they keep their slots), then the queue in order, then migrated-in ones
(t0 moves by the migration's cost: re-prefill, or a KV-cache copy).

Speed (the simulator must run 1,024 devices x 100 steps in seconds on one core): `lay_out` builds the
epochs of *many* instances in one vectorised pass (segmented cumsums and lexsorts over all their sequences:
every instance at step start, every instance a decision touched), and `snapshot_many` answers the signal
queries (running, started, tokens, progress, groups left, rate) of all live instances at once: the epochs'
sorted arrays are packed end to end with an offset per instance (`key = value + rank * span`, span larger
than any value), so one `searchsorted` per quantity serves every instance. No Python loop runs per sequence,
and only O(1) Python work runs per instance.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from tidal.scheduler.costs import DecodeCost


@dataclass
class Work:
    """Unfinished sequences of some groups: `gid[k]`, remaining tokens `rem[k]`, tokens generated `prog[k]`."""

    gid: np.ndarray
    rem: np.ndarray
    prog: np.ndarray

    @staticmethod
    def empty() -> "Work":
        z = np.zeros(0, dtype=np.int64)
        return Work(z, z.astype(np.float64), z.astype(np.float64))

    def __len__(self) -> int:
        return int(self.gid.size)

    @staticmethod
    def cat(parts: list["Work"]) -> "Work":
        parts = [p for p in parts if len(p)]
        if not parts:
            return Work.empty()
        if len(parts) == 1:
            return parts[0]
        return Work(np.concatenate([p.gid for p in parts]), np.concatenate([p.rem for p in parts]),
                    np.concatenate([p.prog for p in parts]))


class Epoch:
    """One instance's laid-out work from wall time `t0` (arrays are views into a batch's packed arrays).

    tb, wb, sums, busy: breakpoints (token clock, wall clock, tokens generated, lanes busy after it);
    F, S: finish/start token clock per sequence in work order; f_sorted with done_len/done_prog (prefix sums
    of remaining/progress tokens in finish order, leading 0); s_sorted; gwall/gids: group ends in wall order;
    gstart: sorted group start token clocks."""

    __slots__ = ("t0", "work", "n", "tb", "wb", "sums", "busy", "F", "S", "f_sorted", "done_len", "done_prog",
                 "s_sorted", "gwall", "gwall_a", "gids", "gstart", "end", "prog_total")

    @staticmethod
    def empty(t0: float) -> "Epoch":
        e = Epoch()
        z = np.zeros(0)
        e.t0, e.work, e.n = t0, Work.empty(), 0
        e.tb, e.wb, e.sums, e.busy = np.zeros(1), np.full(1, t0), np.zeros(1), np.zeros(1, np.int64)
        e.F = e.S = e.f_sorted = e.s_sorted = e.gstart = z
        e.done_len = e.done_prog = np.zeros(1)
        e.gwall, e.gids, e.gwall_a = [], [], z
        e.end, e.prog_total = t0, 0.0
        return e

    def clock(self, t: float) -> float:
        """Token clock at wall time t."""
        wb = self.wb
        if t <= wb[0]:
            return 0.0
        i = int(np.searchsorted(wb, t, side="right")) - 1
        if i >= wb.size - 1:
            return float(self.tb[-1])
        tb = self.tb
        return float(tb[i] + (t - wb[i]) * (tb[i + 1] - tb[i]) / (wb[i + 1] - wb[i]))

    def tokens(self, t: float) -> float:
        """Tokens generated in this epoch by wall time t."""
        if self.n == 0 or t <= self.t0:
            return 0.0
        if t >= self.end:
            return float(self.sums[-1])
        i = int(np.searchsorted(self.wb, t, side="right")) - 1
        T = self.clock(t)
        return float(self.sums[i] + (T - self.tb[i]) * self.busy[i])

    def unfinished(self, t: float) -> Work:
        """Sequences not finished at t (running ones first, so they keep their slots, then the queue)."""
        if not self.n or t >= self.end:
            return Work.empty()
        T = self.clock(t)
        w = self.work
        gen = np.clip(T - self.S, 0.0, w.rem)
        left = w.rem - gen
        keep = left > 1e-9
        started = (gen > 0) & keep
        order = np.concatenate([np.nonzero(started)[0], np.nonzero(keep & ~started)[0]])
        return Work(w.gid[order], left[order], w.prog[order] + gen[order])


def _seg_starts(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def lay_out(works: list[Work], t0s: list[float], slots: int, decode: DecodeCost) -> list[Epoch]:
    """Epochs for many instances in one vectorised pass (see the module docstring)."""
    k = len(works)
    ns = np.array([len(w) for w in works], dtype=np.int64)
    total = int(ns.sum())
    if total == 0:
        return [Epoch.empty(t) for t in t0s]
    t0 = np.asarray(t0s, dtype=np.float64)
    gid = np.concatenate([w.gid for w in works]).astype(np.int64, copy=False)
    rem = np.concatenate([w.rem for w in works]).astype(np.float64, copy=False)
    prog = np.concatenate([w.prog for w in works]).astype(np.float64, copy=False)
    ii = np.repeat(np.arange(k), ns)
    starts = _seg_starts(ns)
    j = np.arange(total) - starts[ii]
    # lanes: sequence j on lane j mod M, after that lane's earlier sequences (segmented cumsum)
    lane_key = ii * slots + j % slots
    order = np.argsort(lane_key, kind="stable")
    r = rem[order]
    c = np.cumsum(r)
    lk = lane_key[order]
    first = np.empty(total, dtype=bool)
    first[0] = True
    np.not_equal(lk[1:], lk[:-1], out=first[1:])
    seg0 = np.flatnonzero(first)
    seg = np.cumsum(first) - 1
    f_lane = c - (c - r)[seg0][seg]
    F = np.empty(total)
    F[order] = f_lane
    S = F - rem
    # lane totals sorted within each instance -> breakpoints of wall(T)
    last = np.empty(seg0.size, dtype=np.int64)
    last[:-1] = seg0[1:] - 1
    last[-1] = total - 1
    tot = f_lane[last]
    tinst = lk[seg0] // slots
    o = np.lexsort((tot, tinst))
    tot, tinst = tot[o], tinst[o]
    L = np.bincount(tinst, minlength=k)
    lstart = _seg_starts(L)
    kidx = np.arange(tot.size) - lstart[tinst]
    ctot = np.cumsum(tot)
    csum = ctot - (ctot - tot)[lstart[tinst]]
    sum_at = csum + tot * (L[tinst] - kidx - 1)          # sum_l min(u_l, T) at T = tot[k]
    B = L + 1
    bstart = _seg_starts(B)
    tb = np.zeros(int(B.sum()))
    sums = np.zeros_like(tb)
    pos = bstart[tinst] + 1 + kidx
    tb[pos] = tot
    sums[pos] = sum_at
    bi = np.repeat(np.arange(k), B)
    busy = L[bi] - (np.arange(tb.size) - bstart[bi])
    wb = t0[bi] + decode.step_s * tb + decode.per_seq_s * sums
    # finish order (done prefix sums) and start order, per instance
    of = np.lexsort((F, ii))
    f_sorted = F[of]
    D = ns + 1
    dstart = _seg_starts(D)
    dpos = dstart[ii] + 1 + j                              # j-th in finish order after sorting
    done_len, done_prog = np.zeros(int(D.sum())), np.zeros(int(D.sum()))
    cl, cp = np.cumsum(rem[of]), np.cumsum(prog[of])
    done_len[dpos] = cl - (cl - rem[of])[starts[ii]]
    done_prog[dpos] = cp - (cp - prog[of])[starts[ii]]
    s_sorted = S[np.lexsort((S, ii))]
    # groups (a group lives on one instance): end = max F, start = min S; end on the wall clock by interpolation
    ug, ginv = np.unique(gid, return_inverse=True)
    gend = np.full(ug.size, -1.0)
    np.maximum.at(gend, ginv, F)
    gst = np.full(ug.size, np.inf)
    np.minimum.at(gst, ginv, S)
    ginst = np.empty(ug.size, dtype=np.int64)
    ginst[ginv] = ii
    span = float(tb.max()) + 1.0
    idx = np.searchsorted(tb + bi * span, gend + ginst * span, side="right") - 1
    idx = np.clip(idx, bstart[ginst], bstart[ginst] + B[ginst] - 2)
    dt = tb[idx + 1] - tb[idx]
    frac = np.divide(gend - tb[idx], dt, out=np.zeros_like(dt), where=dt > 0)
    gwall = wb[idx] + frac * (wb[idx + 1] - wb[idx])
    og = np.lexsort((gwall, ginst))
    gwall_s = gwall[og]
    gwall_l, gid_l = gwall_s.tolist(), ug[og].tolist()
    G = np.bincount(ginst, minlength=k)
    gstart_o = _seg_starts(G)
    gst_sorted = gst[np.lexsort((gst, ginst))]
    out = []
    for i in range(k):
        if ns[i] == 0:
            out.append(Epoch.empty(float(t0[i])))
            continue
        e = Epoch()
        a, b = starts[i], starts[i] + ns[i]
        e.t0, e.n = float(t0[i]), int(ns[i])
        e.work = Work(gid[a:b], rem[a:b], prog[a:b])
        e.F, e.S, e.f_sorted, e.s_sorted = F[a:b], S[a:b], f_sorted[a:b], s_sorted[a:b]
        ba, bb = bstart[i], bstart[i] + B[i]
        e.tb, e.wb, e.sums, e.busy = tb[ba:bb], wb[ba:bb], sums[ba:bb], busy[ba:bb]
        da = dstart[i]
        e.done_len, e.done_prog = done_len[da:da + D[i]], done_prog[da:da + D[i]]
        ga, gb = gstart_o[i], gstart_o[i] + G[i]
        e.gwall, e.gids, e.gstart = gwall_l[ga:gb], gid_l[ga:gb], gst_sorted[ga:gb]
        e.gwall_a = gwall_s[ga:gb]
        e.end = float(wb[bb - 1])
        e.prog_total = float(prog[a:b].sum())
        out.append(e)
    return out


class Instance:
    """Mutable simulator state of one instance. Ids follow devices (the instance's first device id)."""

    def __init__(self, iid: int, devices: tuple[int, ...], slots: int, lent: bool = False):
        self.id, self.devices, self.slots, self.lent = iid, devices, slots, lent
        self.version = 0
        self.total = 0                 # sequences ever assigned this step (RLinf's total_tasks)
        self.tokens_before = 0.0       # tokens generated in earlier epochs this step
        self.busy_s = 0.0              # wall seconds with at least one sequence unfinished
        self.queue: list[int] = []     # group ids in queue order (unfinished and finished)
        self.ready_at = 0.0            # weights loaded, can start generating
        self.set_epoch(Epoch.empty(0.0))

    def assign(self, groups: list[int], sequences: int) -> None:
        """Start of step: the instance's fixed slice (its epoch is laid out by the caller, in a batch)."""
        self.total = sequences
        self.tokens_before = 0.0
        self.busy_s = 0.0
        self.queue = list(groups)

    def set_epoch(self, e: Epoch) -> None:
        self.version += 1
        self.e = e
        self.next_group = 0            # index into e.gwall of the next group to report
        self._closed = False

    @property
    def end(self) -> float:
        return self.e.end

    def close_epoch(self, t: float) -> None:
        """Account busy time and generated tokens of the epoch up to t."""
        e = self.e
        if e.n and not self._closed:
            self.busy_s += max(0.0, min(t, e.end) - e.t0)
            self.tokens_before += e.tokens(t)
        self._closed = True

    def next_event(self) -> float | None:
        """Wall time of the next group to finish (None: nothing left)."""
        gw = self.e.gwall
        return gw[self.next_group] if self.next_group < len(gw) else None

    def pop_due(self, now: float) -> list[int]:
        """Groups finished by `now` not reported yet."""
        gw = self.e.gwall
        k = bisect_right(gw, now + 1e-9, lo=self.next_group)
        out = self.e.gids[self.next_group:k]
        self.next_group = k
        return out

    def settle(self, now: float) -> tuple[list[int], Work]:
        """Report every group finished by `now` (by wall time or token clock) and return what is left."""
        due = self.pop_due(now)
        rest = self.e.unfinished(now)
        present = set(rest.gid.tolist())
        late = [g for g in self.e.gids[self.next_group:] if g not in present]
        self.next_group = len(self.e.gids)
        return due + late, rest

    def split_last_groups(self, now: float, count: int, rest: Work) -> tuple[Work, Work]:
        """Split `rest` (this instance's unfinished work at now) into (kept, the last `count` unfinished
        groups in queue order)."""
        unfinished = set(rest.gid.tolist())
        pending = [g for g in self.queue if g in unfinished]
        count = min(count, len(pending))  # a group may have finished since the signal was sampled
        if not count:
            return rest, Work.empty()
        moving = pending[len(pending) - count:]
        mask = np.isin(rest.gid, moving)
        mv = set(moving)
        self.queue = [g for g in self.queue if g not in mv]
        return (Work(rest.gid[~mask], rest.rem[~mask], rest.prog[~mask]),
                Work(rest.gid[mask], rest.rem[mask], rest.prog[mask]))


class Packed:
    """The epochs of a list of instances packed end to end (module docstring); `at(t)` answers the signal
    queries of all of them at once. Valid while none of them gets a new epoch (the simulator caches it)."""

    def __init__(self, insts: list[Instance], decode: DecodeCost):
        k = len(insts)
        eps = [i.e for i in insts]
        self.decode = decode
        self.ns = ns = np.fromiter((e.n for e in eps), np.int64, k)
        nb = np.fromiter((e.tb.size for e in eps), np.int64, k)
        self.ng = ng = np.fromiter((len(e.gwall) for e in eps), np.int64, k)
        t0 = np.fromiter((e.t0 for e in eps), np.float64, k)
        self.tb = tb = np.concatenate([e.tb for e in eps])
        wb = np.concatenate([e.wb for e in eps])
        self.wb, self.sums = wb, np.concatenate([e.sums for e in eps])
        self.busy = np.concatenate([e.busy for e in eps])
        self.nb, self.bstart = nb, _seg_starts(nb)
        self.rank = rank = np.arange(k)
        bi = np.repeat(rank, nb)
        self.tref = tref = float(t0.min()) if k else 0.0
        self.wspan = wspan = float(wb.max() - tref) + 2.0
        self.wkeys = wb - tref + bi * wspan
        self.tspan = tspan = float(tb.max()) + 2.0
        seq_rank = np.repeat(rank, ns)
        self.sstart = _seg_starts(ns)
        self.fkeys = np.concatenate([e.f_sorted for e in eps]) + seq_rank * tspan
        self.skeys = np.concatenate([e.s_sorted for e in eps]) + seq_rank * tspan
        self.dstart = _seg_starts(ns + 1)
        self.dl = np.concatenate([e.done_len for e in eps])
        self.dp = np.concatenate([e.done_prog for e in eps])
        self.prog_total = np.fromiter((e.prog_total for e in eps), np.float64, k)
        g_rank = np.repeat(rank, ng)
        self.gstart0 = _seg_starts(ng)
        self.gwkeys = np.concatenate([e.gwall_a for e in eps]) - tref + g_rank * wspan
        self.gskeys = np.concatenate([e.gstart for e in eps]) + g_rank * tspan
        self.tokens_before = np.fromiter((x.tokens_before for x in insts), np.float64, k)

    def at(self, t: float) -> dict[str, np.ndarray]:
        tb, wb, busy, sums = self.tb, self.wb, self.busy, self.sums
        bstart, nb, rank, ns, ng = self.bstart, self.nb, self.rank, self.ns, self.ng
        wspan, tspan = self.wspan, self.tspan
        rel_t = min(max(t - self.tref, -0.5), wspan - 1.0)
        wq = rel_t + rank * wspan
        i = np.searchsorted(self.wkeys, wq, side="right") - 1
        i = np.clip(i, bstart, bstart + nb - 1)
        inner = i < bstart + nb - 1
        nxt = np.minimum(i + 1, tb.size - 1)
        dw = wb[nxt] - wb[i]
        frac = np.divide(t - wb[i], dw, out=np.zeros_like(dw), where=inner & (dw > 0))
        np.clip(frac, 0.0, 1.0, out=frac)
        before = t <= wb[bstart]
        T = np.where(before, 0.0, np.where(inner, tb[i] + frac * (tb[nxt] - tb[i]), tb[i]))
        tokens = np.where(before, 0.0, np.where(inner, sums[i] + (T - tb[i]) * busy[i], sums[i]))
        lanes = np.where(inner & ~before, busy[i], np.where(before & (ns > 0), busy[bstart], 0))
        tq = T + rank * tspan
        done = np.searchsorted(self.fkeys, tq, side="right") - self.sstart
        started = np.where(T > 0, np.searchsorted(self.skeys, tq, side="left") - self.sstart, 0)
        di = self.dstart + done
        progress = np.maximum(tokens - self.dl[di] + self.prog_total - self.dp[di], 0.0)
        g_done = np.searchsorted(self.gwkeys, wq, side="right") - self.gstart0
        g_started = np.where(T > 0, np.searchsorted(self.gskeys, tq, side="left") - self.gstart0, 0)
        d = self.decode
        rate = np.where(lanes > 0, lanes / (d.step_s + d.per_seq_s * lanes), 0.0)
        return {
            "running": ns - done,
            "started_unfinished": np.maximum(started - done, 0),
            "queued_seqs": ns - np.maximum(started, done),
            "groups_unfinished": ng - g_done,
            "groups_queued": ng - g_started,
            "tokens": self.tokens_before + tokens,
            "progress": np.where(ns > 0, progress, 0.0),
            "rate": rate,
        }


def snapshot_many(insts: list[Instance], t: float, decode: DecodeCost) -> dict[str, np.ndarray]:
    """Signal quantities of every instance in `insts` at wall time t, vectorised (module docstring)."""
    return Packed(insts, decode).at(t)
