"""Remaining-work estimates from the response lengths seen so far (the producer side of `est_remaining_tokens`).

A sequence that has generated `x` tokens and is not finished has, in expectation, `E[L - x | L > x]` tokens
left (the mean residual life of the length distribution L). For long-tailed lengths this grows with `x`:
the longer a sequence has run, the longer it is expected to keep running, which is exactly what count-based
scheduling (RLinf) misses.

`LengthModel` keeps an immutable table of that residual on a grid of `x`, built from observed lengths;
lookups are O(1). Before any observation it assumes lengths uniform on [1, max_new_tokens].

The *tail* matters as much as the mean: an instance cannot finish before its longest sequence, and decode
steps, not tokens, set its time (`steps * step_s + tokens * per_seq_s`). `tail` estimates the longest
residual among n running sequences that have generated x, as the (1 - 1/(n+1)) quantile of L - x given
L > x (the expected maximum of n draws), tabulated on the x grid and on n = 2^k - 1.

    >>> m = LengthModel.fit([100, 100, 100, 1000], max_new_tokens=1024)
    >>> round(m.residual(0)), round(m.residual(512))
    (325, 488)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

GRID = 64
NK = 16            #: tail table columns: n = 2^k - 1, k = 0..NK-1


@dataclass(frozen=True)
class LengthModel:
    max_new_tokens: int
    mean: float                     #: mean response length
    table: tuple[float, ...]        #: residual life at x = k * step, k = 0..GRID
    step: float
    samples: int = 0
    tail: tuple[tuple[float, ...], ...] = ()  #: tail[g][k]: longest residual of 2^k - 1 sequences at x = g*step

    @classmethod
    def prior(cls, max_new_tokens: int) -> LengthModel:
        step = max_new_tokens / GRID
        table = tuple(max(1.0, (max_new_tokens - k * step) / 2) for k in range(GRID + 1))
        q = 1.0 - 1.0 / 2.0 ** np.arange(NK)                     # uniform on (x, cap]: quantile q
        tail = tuple(tuple(float(max(1.0, (max_new_tokens - g * step) * qq)) for qq in q) for g in range(GRID + 1))
        return cls(max_new_tokens, (max_new_tokens + 1) / 2, table, step, 0, tail)

    @classmethod
    def fit(cls, lengths: Sequence[float] | np.ndarray, max_new_tokens: int) -> LengthModel:
        ls = np.sort(np.asarray(lengths, dtype=np.float64))
        if ls.size == 0:
            return cls.prior(max_new_tokens)
        step = max_new_tokens / GRID
        xs = np.arange(GRID + 1) * step
        csum = np.concatenate([[0.0], np.cumsum(ls[::-1])])[::-1]  # csum[i] = sum(ls[i:])
        idx = np.searchsorted(ls, xs, side="right")                  # first length > x
        cnt = ls.size - idx
        with np.errstate(invalid="ignore", divide="ignore"):
            res = np.where(cnt > 0, csum[idx] / np.maximum(cnt, 1) - xs, 0.0)
        # beyond the largest observation: assume the sequence runs to the cap, half-way on average
        res = np.where(cnt > 0, res, np.maximum((max_new_tokens - xs) / 2, 1.0))
        q = 1.0 - 1.0 / 2.0 ** np.arange(NK)
        qi = np.minimum(idx[:, None] + np.floor(cnt[:, None] * q[None, :]).astype(np.int64), ls.size - 1)
        tl = np.where(cnt[:, None] > 0, ls[qi] - xs[:, None], (max_new_tokens - xs[:, None]) * q[None, :])
        tail = tuple(tuple(float(max(v, 1.0)) for v in row) for row in tl)
        return cls(max_new_tokens, float(ls.mean()), tuple(float(max(r, 1.0)) for r in res), step, int(ls.size),
                   tail)

    def residual(self, x: float) -> float:
        """Expected tokens still to come for a sequence that has generated `x` and is not done."""
        k = int(x / self.step)
        return self.table[min(max(k, 0), GRID)]

    @cached_property
    def _tail_array(self) -> np.ndarray:
        return np.asarray(self.tail, dtype=np.float64)

    @cached_property
    def _table_array(self) -> np.ndarray:
        return np.asarray(self.table, dtype=np.float64)

    def tail_many(self, started: np.ndarray, progress_tokens: np.ndarray, queued: np.ndarray) -> np.ndarray:
        """Expected longest remaining sequence per instance: the started ones at their mean progress, or a
        queued one from scratch, whichever is longer (0 when nothing is left)."""
        tab = self._tail_array
        mean_x = np.divide(progress_tokens, started, out=np.zeros(started.shape), where=started > 0)
        g = np.clip((mean_x / self.step).astype(np.int64), 0, GRID)
        ks = np.clip(np.ceil(np.log2(started + 1.0)).astype(np.int64), 0, NK - 1)
        kq = np.clip(np.ceil(np.log2(queued + 1.0)).astype(np.int64), 0, NK - 1)
        t_started = np.where(started > 0, tab[g, ks], 0.0)
        t_queued = np.where(queued > 0, tab[0, kq], 0.0)
        return np.maximum(t_started, t_queued)

    def tail_total(self, started: np.ndarray, progress_tokens: np.ndarray, queued: np.ndarray) -> float:
        """Expected longest remaining sequence over all instances together (`tail_many` of the sums): the
        expected maximum of all sequences, which exceeds the largest per-instance expectation (0 when empty)."""
        if not np.size(started):
            return 0.0
        return float(self.tail_many(np.array([np.sum(started)], dtype=np.float64),
                                    np.array([np.sum(progress_tokens)], dtype=np.float64),
                                    np.array([np.sum(queued)], dtype=np.float64))[0])

    def remaining_many(self, started: np.ndarray, progress_tokens: np.ndarray, queued: np.ndarray) -> np.ndarray:
        """`instance_remaining` for many instances at once (arrays)."""
        mean_x = np.divide(progress_tokens, started, out=np.zeros(started.shape), where=started > 0)
        k = np.clip((mean_x / self.step).astype(np.int64), 0, GRID)
        return started * self._table_array[k] + queued * self.mean

    def instance_remaining(self, started: int, progress_tokens: float, queued: int) -> float:
        """Estimate for one instance: `started` unfinished sequences that generated `progress_tokens` in
        total (their mean progress is used: one lookup per instance), plus `queued` not started."""
        mean_x = progress_tokens / started if started else 0.0
        return started * self.residual(mean_x) + queued * self.mean
