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
re-laid from `now` in the order the caller gives (the simulator: the target's started ones, which keep their
slots, then the started ones migrated in, first in the engine's waiting queue as `import_state` puts them, then
the target's unstarted queue, then unstarted ones migrated in), and t0 moves by the migration's cost (re-prefill,
or a KV-cache copy).

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

from scheduler.costs import DecodeCost


@dataclass
class Work:
    """Unfinished sequences of some groups: `gid[k]`, remaining tokens `rem[k]`, tokens generated `prog[k]`."""

    gid: np.ndarray
    rem: np.ndarray
    prog: np.ndarray

    @staticmethod
    def empty() -> Work:
        z = np.zeros(0, dtype=np.int64)
        return Work(z, z.astype(np.float64), z.astype(np.float64))

    def __len__(self) -> int:
        return int(self.gid.size)

    @staticmethod
    def cat(parts: list[Work]) -> Work:
        parts = [p for p in parts if len(p)]
        if not parts:
            return Work.empty()
        if len(parts) == 1:
            return parts[0]
        return Work(np.concatenate([p.gid for p in parts]), np.concatenate([p.rem for p in parts]),
                    np.concatenate([p.prog for p in parts]))


class _Batch:
    """Packed arrays of the epochs laid out together (offsets per instance); `Epoch` views index into it."""

    __slots__ = ("B", "D", "F", "G", "S", "bstart", "busy", "done_len", "done_prog", "dstart", "f_sorted", "gid",
                 "gids", "gst_sorted", "gstart_o", "gwall", "k", "ns", "prog", "prog_total", "rem", "s_sorted",
                 "starts", "sums", "t0", "tb", "wb")

    # per instance (k of them): wall clock of the epoch's start, sequence count and offset, tokens already generated
    k: int
    t0: np.ndarray
    ns: np.ndarray
    starts: np.ndarray
    prog_total: np.ndarray
    # per sequence, packed at `starts`: group id, remaining and generated tokens, finish/start token clock, sorted
    gid: np.ndarray
    rem: np.ndarray
    prog: np.ndarray
    F: np.ndarray
    S: np.ndarray
    f_sorted: np.ndarray
    s_sorted: np.ndarray
    # breakpoints of wall(T): count B and offset per instance; token clock, wall clock, tokens, lanes busy
    B: np.ndarray
    bstart: np.ndarray
    tb: np.ndarray
    wb: np.ndarray
    sums: np.ndarray
    busy: np.ndarray
    # done prefix sums in finish order (ns + 1 per instance): count D and offset, remaining and progress tokens
    D: np.ndarray
    dstart: np.ndarray
    done_len: np.ndarray
    done_prog: np.ndarray
    # groups: count G and offset per instance, their ends (wall clock) and ids in wall order, sorted starts
    G: np.ndarray
    gstart_o: np.ndarray
    gwall: np.ndarray
    gids: np.ndarray
    gst_sorted: np.ndarray

    @staticmethod
    def empty(t0s: list[float]) -> _Batch:
        b = _Batch()
        k = len(t0s)
        z, zi, ones = np.zeros(0), np.zeros(0, np.int64), np.ones(k, np.int64)
        b.k, b.t0, b.ns, b.starts = k, np.asarray(t0s, dtype=np.float64), np.zeros(k, np.int64), np.zeros(k, np.int64)
        b.gid, b.rem, b.prog, b.F, b.S, b.f_sorted, b.s_sorted = zi, z, z, z, z, z, z
        b.B, b.bstart, b.tb, b.wb = ones, np.arange(k), np.zeros(k), b.t0.copy()
        b.sums, b.busy = np.zeros(k), np.zeros(k, np.int64)
        b.D, b.dstart, b.done_len, b.done_prog = ones, np.arange(k), np.zeros(k), np.zeros(k)
        b.G, b.gstart_o, b.gwall, b.gst_sorted = np.zeros(k, np.int64), np.zeros(k, np.int64), z, z
        b.gids = zi
        b.prog_total = np.zeros(k)
        return b


class Epoch:
    """One instance's laid-out work from wall time `t0`: a view (offsets) into the `_Batch` it was laid out in.

    tb, wb, sums, busy: breakpoints (token clock, wall clock, tokens generated, lanes busy after it);
    F, S: finish/start token clock per sequence in work order; f_sorted with done_len/done_prog (prefix sums
    of remaining/progress tokens in finish order, leading 0); s_sorted; gwall/gids: group ends in wall order
    (Python lists: the event loop reads them); gstart: sorted group start token clocks."""

    __slots__ = ("b", "end", "gids", "gwall", "i", "n", "t0")

    def __init__(self, b: _Batch, i: int, gwall: list[float], gids: list[int]):
        self.b, self.i = b, i
        self.t0, self.n = float(b.t0[i]), int(b.ns[i])
        self.end = float(b.wb[b.bstart[i] + b.B[i] - 1])
        self.gwall, self.gids = gwall, gids

    @staticmethod
    def empty(t0: float) -> Epoch:
        return Epoch(_Batch.empty([t0]), 0, [], [])

    def rebased(self, b: _Batch, i: int) -> Epoch:
        """The same epoch, viewing `b[i]` (a compacted copy) instead of its original batch."""
        e = Epoch.__new__(Epoch)
        e.b, e.i, e.t0, e.n, e.end, e.gwall, e.gids = b, i, self.t0, self.n, self.end, self.gwall, self.gids
        return e

    def _seq(self, arr: np.ndarray) -> np.ndarray:
        a = self.b.starts[self.i]
        return arr[a:a + self.n]

    def _bp(self, arr: np.ndarray) -> np.ndarray:
        a = self.b.bstart[self.i]
        return arr[a:a + self.b.B[self.i]]

    work = property(lambda self: Work(self._seq(self.b.gid), self._seq(self.b.rem), self._seq(self.b.prog)))
    F = property(lambda self: self._seq(self.b.F))
    S = property(lambda self: self._seq(self.b.S))
    f_sorted = property(lambda self: self._seq(self.b.f_sorted))
    s_sorted = property(lambda self: self._seq(self.b.s_sorted))
    tb = property(lambda self: self._bp(self.b.tb))
    wb = property(lambda self: self._bp(self.b.wb))
    sums = property(lambda self: self._bp(self.b.sums))
    busy = property(lambda self: self._bp(self.b.busy))
    done_len = property(lambda self: self.b.done_len[self.b.dstart[self.i]:self.b.dstart[self.i] + self.n + 1])
    done_prog = property(lambda self: self.b.done_prog[self.b.dstart[self.i]:self.b.dstart[self.i] + self.n + 1])
    gwall_a = property(lambda self: self.b.gwall[self.b.gstart_o[self.i]:self.b.gstart_o[self.i] + self.b.G[self.i]])
    gstart = property(lambda self: self.b.gst_sorted[self.b.gstart_o[self.i]:
                                                     self.b.gstart_o[self.i] + self.b.G[self.i]])
    prog_total = property(lambda self: float(self.b.prog_total[self.i]))

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


def _seg_order(values: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Stable order by (seg, values) for non-decreasing integer `seg` (np.lexsort is ~50x slower here): one
    argsort of `seg * span + values` with span beyond the values' range."""
    if not values.size:
        return np.zeros(0, dtype=np.int64)
    lo = float(values.min())
    span = float(values.max()) - lo + 1.0
    return np.argsort(seg * span + (values - lo), kind="stable")


def lay_out(works: list[Work], t0s: list[float], slots: int, decode: DecodeCost) -> list[Epoch]:
    """Epochs for many instances in one vectorised pass (see the module docstring): each step fills one family
    of the `_Batch`'s packed columns."""
    k = len(works)
    ns = np.array([len(w) for w in works], dtype=np.int64)
    if int(ns.sum()) == 0:
        bt = _Batch.empty(list(t0s))
        return [Epoch(bt, i, [], []) for i in range(k)]
    bt = _Batch()
    ii, j = _pack_sequences(bt, works, t0s, ns)
    tot, tinst = _lay_lanes(bt, ii, j, slots)
    bi = _breakpoints(bt, tot, tinst, decode)
    _finish_and_start_order(bt, ii, j)
    gwall_l, gid_l = _group_ends(bt, ii, bi)
    go = bt.gstart_o.tolist()
    ge = (bt.gstart_o + bt.G).tolist()
    return [Epoch(bt, i, gwall_l[go[i]:ge[i]], gid_l[go[i]:ge[i]]) for i in range(k)]


def _pack_sequences(bt: _Batch, works: list[Work], t0s: list[float],
                    ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack the works end to end into `bt` (k, t0, ns, starts, gid, rem, prog, prog_total); return, per
    sequence, its instance `ii` and its position `j` in that instance's work."""
    k = len(works)
    total = int(ns.sum())
    t0 = np.asarray(t0s, dtype=np.float64)
    gid = np.concatenate([w.gid for w in works]).astype(np.int64, copy=False)
    rem = np.concatenate([w.rem for w in works]).astype(np.float64, copy=False)
    prog = np.concatenate([w.prog for w in works]).astype(np.float64, copy=False)
    ii = np.repeat(np.arange(k), ns)
    starts = _seg_starts(ns)
    j = np.arange(total) - starts[ii]
    bt.k, bt.t0, bt.ns, bt.starts, bt.gid, bt.rem, bt.prog = k, t0, ns, starts, gid, rem, prog
    pc = np.concatenate([[0.0], np.cumsum(prog)])
    bt.prog_total = pc[starts + ns] - pc[starts]
    return ii, j


def _lay_lanes(bt: _Batch, ii: np.ndarray, j: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Fill `bt.F`, `bt.S` (finish/start token clock per sequence); return each lane's total and its instance,
    lanes in (instance, lane) order."""
    rem = bt.rem
    total = rem.size
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
    bt.F, bt.S = F, F - rem
    last = np.empty(seg0.size, dtype=np.int64)
    last[:-1] = seg0[1:] - 1
    last[-1] = total - 1
    return f_lane[last], lk[seg0] // slots


def _breakpoints(bt: _Batch, tot: np.ndarray, tinst: np.ndarray, decode: DecodeCost) -> np.ndarray:
    """Lane totals sorted within each instance -> breakpoints of wall(T): fill `bt` (B, bstart, tb, wb, sums,
    busy); return each breakpoint's instance."""
    k = bt.k
    o = _seg_order(tot, tinst)
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
    wb = bt.t0[bi] + decode.step_s * tb + decode.per_seq_s * sums
    bt.B, bt.bstart, bt.tb, bt.wb, bt.sums, bt.busy = B, bstart, tb, wb, sums, busy
    return bi


def _finish_and_start_order(bt: _Batch, ii: np.ndarray, j: np.ndarray) -> None:
    """Finish order (done prefix sums) and start order, per instance: fill `bt` (f_sorted, D, dstart,
    done_len, done_prog, s_sorted)."""
    F, S, rem, prog, ns, starts = bt.F, bt.S, bt.rem, bt.prog, bt.ns, bt.starts
    of = _seg_order(F, ii)
    f_sorted = F[of]
    D = ns + 1
    dstart = _seg_starts(D)
    dpos = dstart[ii] + 1 + j                              # j-th in finish order after sorting
    done_len, done_prog = np.zeros(int(D.sum())), np.zeros(int(D.sum()))
    cl, cp = np.cumsum(rem[of]), np.cumsum(prog[of])
    done_len[dpos] = cl - (cl - rem[of])[starts[ii]]
    done_prog[dpos] = cp - (cp - prog[of])[starts[ii]]
    s_sorted = S[_seg_order(S, ii)]
    bt.f_sorted, bt.s_sorted = f_sorted, s_sorted
    bt.D, bt.dstart, bt.done_len, bt.done_prog = D, dstart, done_len, done_prog


def _group_ends(bt: _Batch, ii: np.ndarray, bi: np.ndarray) -> tuple[list[float], list[int]]:
    """Fill `bt`'s group columns (G, gstart_o, gwall, gst_sorted, gids); return the group ends (wall clock)
    and ids in wall order as Python lists (the event loop reads them)."""
    k = bt.k
    gid, F, S, tb, wb, bstart, B = bt.gid, bt.F, bt.S, bt.tb, bt.wb, bt.bstart, bt.B
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
    og = _seg_order(gwall, ginst)
    gwall_s = gwall[og]
    gids = ug[og]
    G = np.bincount(ginst, minlength=k)
    gstart_o = _seg_starts(G)
    gst_sorted = gst[_seg_order(gst, ginst)]
    bt.G, bt.gstart_o, bt.gwall, bt.gst_sorted, bt.gids = G, gstart_o, gwall_s, gst_sorted, gids
    return gwall_s.tolist(), gids.tolist()


_EMPTY = Epoch.empty(0.0)   # shared placeholder of a new instance (never mutated)


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
        self.set_epoch(_EMPTY)

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

    def settled(self, t: float, tokens: float) -> None:
        """`close_epoch` + `settle` done by `settle_many` (which computed `tokens`, the epoch's tokens at t)."""
        e = self.e
        if e.n and not self._closed:
            self.busy_s += max(0.0, min(t, e.end) - e.t0)
            self.tokens_before += tokens
        self._closed = True
        self.next_group = len(e.gids)

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
        mark = np.zeros(int(rest.gid.max()) + 1, dtype=bool)
        mark[moving] = True
        mask = mark[rest.gid]
        mv = set(moving)
        self.queue = [g for g in self.queue if g not in mv]
        return (Work(rest.gid[~mask], rest.rem[~mask], rest.prog[~mask]),
                Work(rest.gid[mask], rest.rem[mask], rest.prog[mask]))


def _gather(eps: list[Epoch]) -> _Batch:
    """One `_Batch` holding the given epochs in order (vectorised gathers from the batches they came from)."""
    k = len(eps)
    blist: list[_Batch] = []
    pos: dict[int, int] = {}
    bidx = np.empty(k, dtype=np.int64)
    for j, e in enumerate(eps):
        p = pos.get(id(e.b))
        if p is None:
            p = pos[id(e.b)] = len(blist)
            blist.append(e.b)
        bidx[j] = p
    iidx = np.fromiter((e.i for e in eps), np.int64, k)
    gi = _seg_starts(np.array([b.k for b in blist], dtype=np.int64))[bidx] + iidx

    def cat(name: str) -> np.ndarray:
        return getattr(blist[0], name) if len(blist) == 1 else np.concatenate([getattr(b, name) for b in blist])

    def family(start: str, count: str, sized: str, extra: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        off = _seg_starts(np.array([getattr(b, sized).size for b in blist], dtype=np.int64))
        st = off[bidx] + cat(start)[gi]
        ln = cat(count)[gi] + extra
        new_start = _seg_starts(ln)
        idx = np.repeat(st - new_start, ln) + np.arange(int(ln.sum()))
        return idx, ln, new_start

    out = _Batch()
    out.k, out.t0, out.prog_total = k, cat("t0")[gi], cat("prog_total")[gi]
    idx, out.ns, out.starts = family("starts", "ns", "gid")
    for name in ("gid", "rem", "prog", "F", "S", "f_sorted", "s_sorted"):
        setattr(out, name, cat(name)[idx])
    idx, out.B, out.bstart = family("bstart", "B", "tb")
    for name in ("tb", "wb", "sums", "busy"):
        setattr(out, name, cat(name)[idx])
    idx, out.D, out.dstart = family("dstart", "ns", "done_len", extra=1)
    out.done_len, out.done_prog = cat("done_len")[idx], cat("done_prog")[idx]
    idx, out.G, out.gstart_o = family("gstart_o", "G", "gwall")
    out.gwall, out.gst_sorted, out.gids = cat("gwall")[idx], cat("gst_sorted")[idx], cat("gids")[idx]
    return out


class Packed:
    """The epochs of a list of instances packed end to end (module docstring); `at(t)` answers the signal
    queries of all of them at once. Valid while none of them gets a new epoch (the simulator caches it)."""

    def __init__(self, insts: list[Instance], decode: DecodeCost):
        k = len(insts)
        eps = [i.e for i in insts]
        self.decode = decode
        b0 = eps[0].b if eps else None
        if b0 is not None and b0.k == k and all(e.b is b0 and e.i == j for j, e in enumerate(eps)):
            self._from_batch(insts, b0)    # one batch, same order (step start): no repacking
            return
        b = _gather(eps)
        # compaction: the instances now view the gathered copy, so their old batches (which also hold epochs
        # replaced since) are freed and later gathers copy live data from few batches only
        for j, (inst, e) in enumerate(zip(insts, eps)):
            inst.e = e.rebased(b, j)
        self._from_batch(insts, b)

    def _from_batch(self, insts: list[Instance], b: _Batch) -> None:
        k = b.k
        self.b, self.insts = b, insts
        self.pos = {id(x): r for r, x in enumerate(insts)}
        self.ns, self.ng, self.nb = b.ns, b.G, b.B
        self.tb, self.wb, self.sums, self.busy, self.bstart = b.tb, b.wb, b.sums, b.busy, b.bstart
        self.rank = rank = np.arange(k)
        bi = np.repeat(rank, b.B)
        self.tref = tref = float(b.t0.min())
        self.wspan = wspan = float(b.wb.max() - tref) + 2.0
        self.wkeys = b.wb - tref + bi * wspan
        self.tspan = tspan = float(b.tb.max()) + 2.0
        seq_rank = np.repeat(rank, b.ns)
        self.sstart = b.starts
        self.fkeys = b.f_sorted + seq_rank * tspan
        self.skeys = b.s_sorted + seq_rank * tspan
        self.dstart, self.dl, self.dp = b.dstart, b.done_len, b.done_prog
        self.prog_total = b.prog_total
        g_rank = np.repeat(rank, b.G)
        self.gstart0 = b.gstart_o
        self.gwkeys = b.gwall - tref + g_rank * wspan
        self.gskeys = b.gst_sorted + g_rank * tspan
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
            "T": T,
            "epoch_tokens": tokens,
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


def settle_many(insts: list[Instance], t: float, decode: DecodeCost,
                packed: Packed | None = None, q: dict | None = None) -> list[tuple[list[int], Work, float]]:
    """`Instance.settle` + the epoch's tokens at t for many instances in one vectorised pass: per instance,
    (groups finished and not reported yet, in wall order; the unfinished work, running sequences first; tokens
    this epoch generated by t). `packed` (+ its `at(t)` result `q`) may cover more instances than `insts`
    (the simulator passes the decision's snapshot: no repacking)."""
    if packed is None:
        packed = Packed(insts, decode)
    if q is None:
        q = packed.at(t)
    b = packed.b
    pos = packed.pos
    ranks = np.fromiter((pos[id(x)] for x in insts), np.int64, len(insts))
    k = packed.rank.size
    sel = np.zeros(k, dtype=bool)
    sel[ranks] = True
    seq_rank = np.repeat(packed.rank, b.ns)
    sseq = sel[seq_rank]
    S, rem, prog, gid, sr = b.S[sseq], b.rem[sseq], b.prog[sseq], b.gid[sseq], seq_rank[sseq]
    gen = np.clip(q["T"][sr] - S, 0.0, rem)
    left = rem - gen
    keep = left > 1e-9
    started = (gen > 0) & keep
    kidx = np.flatnonzero(keep)
    o = kidx[np.argsort(sr[kidx] * 2 + (~started[kidx]), kind="stable")]
    gid_o, left_o, prog_o = gid[o], left[o], prog[o] + gen[o]
    offs = np.concatenate([[0], np.cumsum(np.bincount(sr[kidx], minlength=k))]).tolist()
    present = np.zeros(int(max(b.gids.max(initial=0), b.gid.max(initial=0))) + 1, dtype=bool)
    present[gid_o] = True
    g_rank = np.repeat(packed.rank, b.G)
    gpos = np.arange(b.gids.size) - b.gstart_o[g_rank]
    nextg = np.zeros(k, dtype=np.int64)
    nextg[ranks] = np.fromiter((i.next_group for i in insts), np.int64, len(insts))
    due = sel[g_rank] & (gpos >= nextg[g_rank]) & (~present[b.gids] | (b.gwall <= t + 1e-9))
    due_ids, due_rank = b.gids[due], g_rank[due]
    doffs = np.concatenate([[0], np.cumsum(np.bincount(due_rank, minlength=k))]).tolist()
    due_l = due_ids.tolist()
    tok = q["epoch_tokens"].tolist()
    return [(due_l[doffs[r]:doffs[r + 1]], Work(gid_o[offs[r]:offs[r + 1]], left_o[offs[r]:offs[r + 1]],
                                                prog_o[offs[r]:offs[r + 1]]), tok[r]) for r in ranks.tolist()]
