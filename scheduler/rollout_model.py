"""One rollout instance in the simulator: continuous batching in closed form, events per group.

Model. An instance runs at most M = max_running_requests sequences at once; every decode step advances each
running sequence by one token and takes `step_s + per_seq_s * b` with b sequences running. We measure
progress on a *token clock* T (decode steps since the epoch started) and keep the wall clock as a function
of it. Slots are lanes: sequence j of the epoch's queue runs on lane j mod M, after the earlier sequences of
that lane (an engine gives a freed slot to the next queued request; fixing the lane up front overstates the
tail slightly when an instance holds 1-4x its slots, and is exact up to M). Then, with lane totals u_l::

    wall(T) = t0 + step_s * T + per_seq_s * sum_l min(u_l, T)       (piecewise linear, breakpoints u_l)
    sequence j: starts at S_j (lane prefix), ends at F_j = S_j + len_j; a group ends at max F_j of its seqs

so one epoch costs one vectorised pass (numpy) and each query (running count, tokens so far, rate) is a
bisect. An *epoch* lasts until the instance's work changes (migration in or out); then the unfinished
sequences are re-laid from `now`: running ones first (they keep their slots), then the queue in order, then
migrated-in ones (resubmitted `prompt + generated`, re-prefilled: t0 moves by the prefill time).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
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
        return Work(z, z.copy(), z.copy())

    def __len__(self) -> int:
        return int(self.gid.size)

    @staticmethod
    def cat(parts: list["Work"]) -> "Work":
        parts = [p for p in parts if len(p)]
        if not parts:
            return Work.empty()
        return Work(np.concatenate([p.gid for p in parts]), np.concatenate([p.rem for p in parts]),
                    np.concatenate([p.prog for p in parts]))


class Instance:
    """Mutable simulator state of one instance. Ids follow devices (the instance's first device id)."""

    def __init__(self, iid: int, devices: tuple[int, ...], decode: DecodeCost, slots: int, lent: bool = False):
        self.id, self.devices, self.decode, self.slots, self.lent = iid, devices, decode, slots, lent
        self.version = 0
        self.total = 0                 # sequences ever assigned this step (RLinf's total_tasks)
        self.tokens_before = 0         # tokens generated in earlier epochs this step
        self.busy_s = 0.0              # wall seconds with at least one sequence unfinished
        self.queue: list[int] = []     # group ids in queue order (unfinished and finished)
        self._set(0.0, Work.empty())

    # --- epoch construction -------------------------------------------------------------------------
    def _set(self, t0: float, work: Work, running_first: int = 0) -> None:
        """Lay out `work` from wall time `t0`: sequences in order, lane j mod slots."""
        self.version += 1
        self.next_group = 0            # index into group_end of the next group to report
        self._closed = False
        self._final: dict | None = None  # snapshot once every sequence is done (it no longer changes)
        self._prog_total = float(work.prog.sum()) if len(work) else 0.0
        self.t0 = t0
        n, m = len(work), self.slots
        self.work = work
        self.epoch_start = t0
        if n == 0:
            self.S = self.F = np.zeros(0)
            self._tb, self._wb, self._sum, self._busy = [0.0], [t0], [0.0], [0]
            self.group_end: list[tuple[float, int]] = []
            self.end = t0
            self._f_sorted, self._s_sorted, self._done_len, self._done_prog = [], [], [0.0], [0.0]
            self._gstart: list[float] = []
            return
        rows = -(-n // m)
        lens = np.zeros(rows * m, dtype=np.float64)
        lens[:n] = work.rem
        cum = lens.reshape(rows, m).cumsum(axis=0).reshape(-1)
        F = cum[:n]
        S = F - work.rem
        tot = np.sort(cum[(rows - 1) * m:][: min(n, m)])   # lane totals, one per used lane
        lanes = tot.size
        csum = np.concatenate([[0.0], np.cumsum(tot)])
        k = np.arange(lanes)
        sum_at = csum[k + 1] + tot * (lanes - k - 1)        # sum_l min(u_l, T) at T = tot[k]
        tb = np.concatenate([[0.0], tot])
        sums = np.concatenate([[0.0], sum_at])
        wb = t0 + self.decode.step_s * tb + self.decode.per_seq_s * sums
        self._tb, self._wb, self._sum = tb.tolist(), wb.tolist(), sums.tolist()
        self._busy = (lanes - np.arange(lanes + 1)).tolist()   # lanes still busy on segment i
        self.S, self.F = S, F
        order = np.argsort(F, kind="stable")
        self._f_sorted = F[order].tolist()
        self._done_len = np.concatenate([[0.0], np.cumsum(work.rem[order])]).tolist()
        self._done_prog = np.concatenate([[0.0], np.cumsum(work.prog[order])]).tolist()
        self._s_sorted = np.sort(S).tolist()
        # group end = max F over its sequences; group start = min S
        gids, inv = np.unique(work.gid, return_inverse=True)
        gend = np.full(gids.size, -1.0)
        np.maximum.at(gend, inv, F)
        gstart = np.full(gids.size, np.inf)
        np.minimum.at(gstart, inv, S)
        gwall = np.interp(gend, tb, wb)
        o = np.argsort(gwall, kind="stable")
        self.group_end = list(zip(gwall[o].tolist(), gids[o].tolist()))
        self._gstart = np.sort(gstart).tolist()
        self.end = float(wb[-1])

    def assign(self, now: float, work: Work, groups: list[int], prefill_s: float) -> None:
        """Start of step: the instance's fixed slice."""
        self.total = len(work)
        self.tokens_before = 0
        self.busy_s = 0.0
        self.queue = list(groups)
        self._set(now + prefill_s, work)

    # --- queries at wall time t (bisects) --------------------------------------------------------------
    def _clock(self, t: float) -> tuple[float, int]:
        """Token clock at wall time t and the segment index."""
        wb = self._wb
        if t <= wb[0]:
            return 0.0, 0
        i = bisect_right(wb, t) - 1
        if i >= len(wb) - 1:
            return self._tb[-1], len(wb) - 1
        tb = self._tb
        return tb[i] + (t - wb[i]) * (tb[i + 1] - tb[i]) / (wb[i + 1] - wb[i]), i

    def snapshot(self, t: float) -> dict:
        """Running count, tokens, rate and progress at t (producer side of a RolloutInstanceSignal)."""
        if t >= self.end and self._final is not None:
            return self._final
        T, i = self._clock(t)
        tokens = self._sum[i] + (T - self._tb[i]) * self._busy[i] if i < len(self._tb) - 1 else self._sum[-1]
        n = len(self.work)
        done = bisect_right(self._f_sorted, T)
        started = bisect_left(self._s_sorted, T) if T > 0 else 0
        g_done = bisect_right(self.group_end, (t, float("inf")))
        busy = self._busy[i] if i < len(self._busy) - 1 else 0
        prog = (tokens - self._done_len[done]) + (self._prog_total - self._done_prog[done]) if n else 0.0
        out = {
            "running": n - done,
            "started_unfinished": max(0, started - done),
            "queued_seqs": n - max(started, done),
            "groups_unfinished": len(self.group_end) - g_done,
            "groups_queued": len(self._gstart) - bisect_left(self._gstart, T) if T > 0 else len(self._gstart),
            "tokens": self.tokens_before + int(tokens),
            "progress": max(prog, 0.0),
            "rate": self.decode.rate(busy),
        }
        if t >= self.end and not self._closed:
            self._final = out
        return out

    def unfinished(self, t: float) -> Work:
        """The sequences not finished at t with their remaining tokens and progress (for a re-lay)."""
        if not len(self.work):
            return Work.empty()
        T, _ = self._clock(t)
        gen = np.clip(T - self.S, 0.0, self.work.rem)
        left = self.work.rem - gen
        keep = left > 1e-9
        # running ones (started) first so they keep their slots, then the queue in order
        started = (gen > 0) & keep
        order = np.concatenate([np.nonzero(started)[0], np.nonzero(keep & ~started)[0]])
        return Work(self.work.gid[order], left[order], self.work.prog[order] + gen[order])

    def close_epoch(self, t: float) -> None:
        """Account busy time and generated tokens of the epoch up to t."""
        if len(self.work) and not self._closed:
            self.busy_s += max(0.0, min(t, self.end) - self.epoch_start)
            self.tokens_before = self.snapshot(t)["tokens"]
        self._closed = True

    # --- changes --------------------------------------------------------------------------------------
    def next_event(self) -> float | None:
        """Wall time of the next group to finish (None: nothing left)."""
        return self.group_end[self.next_group][0] if self.next_group < len(self.group_end) else None

    def pop_due(self, now: float) -> list[int]:
        """Groups finished by `now` not reported yet."""
        out = []
        ge = self.group_end
        while self.next_group < len(ge) and ge[self.next_group][0] <= now + 1e-9:
            out.append(ge[self.next_group][1])
            self.next_group += 1
        return out

    def settle(self, now: float) -> tuple[list[int], Work]:
        """Report every group finished by `now` (by wall time or token clock) and return what is left."""
        due = self.pop_due(now)
        rest = self.unfinished(now)
        present = set(rest.gid.tolist())
        late = [g for _, g in self.group_end[self.next_group:] if g not in present]
        self.next_group = len(self.group_end)
        return due + late, rest

    # --- changes --------------------------------------------------------------------------------------
    def take_last_groups(self, now: float, count: int) -> tuple[list[int], Work]:
        """Remove the last `count` (at most all) unfinished groups in queue order; re-lay the rest from now.
        Returns (groups that finished by now, the removed work)."""
        self.close_epoch(now)
        due, rest = self.settle(now)
        unfinished = set(rest.gid.tolist())
        pending = [g for g in self.queue if g in unfinished]
        count = min(count, len(pending))  # a group may have finished since the signal was sampled
        moving = set(pending[len(pending) - count:]) if count else set()
        mask = np.isin(rest.gid, list(moving))
        self.queue = [g for g in self.queue if g not in moving]
        out = Work(rest.gid[mask], rest.rem[mask], rest.prog[mask])
        self._set(now, Work(rest.gid[~mask], rest.rem[~mask], rest.prog[~mask]))
        return due, out

    def receive(self, now: float, work: Work, groups: list[int], delay_s: float) -> list[int]:
        """Append migrated groups (resubmitted: re-prefill delays the instance by `delay_s`).
        Returns the groups that finished by now."""
        self.close_epoch(now)
        due, rest = self.settle(now)
        self.total += len(work)
        self.queue += groups
        self._set(now + delay_s, Work.cat([rest, work]))
        return due

    def unfinished_groups(self, now: float) -> int:
        return self.snapshot(now)["groups_unfinished"]
