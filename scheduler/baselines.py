"""The placements users run today, each at its best, on one workload: what a dynamic schedule must beat.

- `collocated`: every component on every device, phases in turn (`phased.py`);
- `hybrid`: actor and inference share devices, rollout apart; the rollout's share searched (`phased.py`);
- `static`: a disaggregated split that never moves, the best one found by search (`best_static`);
- `rlinf`: RLinf's scheduler with and without both of its flags, on its example split (actor 1/4, rollout 1/2,
  inference 1/4) and on the best static split: the best of the four.

Search: splits `(actor, rollout, inference)` are device counts on a grid of `unit` devices (the TPs' multiple,
at least N / 8), every role at least its TP and the actor at least `min_actor_devices`; the best on the grid is
then improved by moving `fine` devices (N / 32) between two roles at a time until no move shortens the step.
A baseline is searched on the steps it is scored on (its best case); `planner.plan` chooses tidal's placement on
other draws of the workload.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from scheduler.phased import simulate_phased
from scheduler.simulator import SimResult, simulate
from scheduler.workload import SimSpec
from tidal.core.errors import TidalError

Split = tuple[int, int, int]   # (actor, rollout, inference) device counts, placed in that order from device 0


def with_split(spec: SimSpec, split: Split) -> SimSpec:
    a, r, i = split
    p = spec.params
    if a + r + i != p.num_devices:
        raise TidalError("split", split, f"does not cover the {p.num_devices} devices", "actor + rollout + inference")
    return replace(spec, params=replace(p, actor_devices=tuple(range(a)), rollout_devices=tuple(range(a, a + r)),
                                        inference_devices=tuple(range(a + r, a + r + i))))


def _units(spec: SimSpec) -> tuple[int, int, int]:
    p = spec.params
    return p.actor_tp, p.rollout_tp, p.inference_tp


def valid(spec: SimSpec, split: Split) -> bool:
    p = spec.params
    (a, r, i), (ta, tr, ti) = split, _units(spec)
    return (a + r + i == p.num_devices and a >= max(ta, p.min_actor_devices) and r >= tr and i >= ti
            and a % ta == 0 and r % tr == 0 and i % ti == 0)


def grid(spec: SimSpec, unit: int) -> Iterator[Split]:
    n = spec.num_devices
    for a in range(unit, n, unit):
        for r in range(unit, n - a, unit):
            s = (a, r, n - a - r)
            if valid(spec, s):
                yield s


def default_split(spec: SimSpec) -> Split:
    """RLinf's example proportions (1/4, 1/2, 1/4), rounded to the TPs, the actor at least its memory floor."""
    n = spec.num_devices
    ta, tr, ti = _units(spec)
    a = max(spec.params.min_actor_devices, ta, round(n / 4 / ta) * ta)
    i = max(ti, round(n / 4 / ti) * ti)
    r = (n - a - i) // tr * tr
    a = n - r - i   # the rounding remainder goes to the actor (a multiple of its TP when the others' are)
    split = (a, r, i)
    if not valid(spec, split):
        raise TidalError("devices", n, f"cannot place actor, rollout and inference with TPs {ta}/{tr}/{ti}",
                         "use more devices or smaller TPs")
    return split


def search(spec: SimSpec, score: Callable[[Split], float], start: Split | None = None) -> tuple[Split, float]:
    """The split of lowest `score` (module doc: a grid, then moves of `fine` devices between two roles)."""
    n = spec.num_devices
    lcm = math.lcm(*_units(spec))
    unit = max(lcm, n // 8 // lcm * lcm)
    fine = max(lcm, n // 32 // lcm * lcm)
    seen: dict[Split, float] = {}

    def val(s: Split) -> float:
        if s not in seen:
            seen[s] = score(s)
        return seen[s]
    cands = list(grid(spec, unit)) + ([start] if start and valid(spec, start) else [])
    if not cands:
        cands = list(grid(spec, lcm))
    if not cands:
        raise TidalError("devices", n, "leave no valid split of actor, rollout and inference",
                         "use more devices or smaller TPs")
    best = min(cands, key=val)
    improved = True
    while improved:
        improved = False
        for src in range(3):
            for dst in range(3):
                if src == dst:
                    continue
                s = list(best)
                s[src] -= fine
                s[dst] += fine
                t = (s[0], s[1], s[2])
                if valid(spec, t) and val(t) < val(best):
                    best, improved = t, True
    return best, val(best)


@dataclass(frozen=True)
class Arm:
    """One baseline (or tidal) at its best on a workload: its result and how it was placed."""

    name: str
    result: SimResult
    placement: str            #: "collocated", "hybrid rollout R", or "actor A / rollout R / inference I"
    policy: str               #: static, rlinf (+ flags), tidal

    @property
    def mean_step_s(self) -> float:
        return self.result.mean_step_s


def describe_split(split: Split) -> str:
    return f"actor {split[0]} / rollout {split[1]} / inference {split[2]}"


def collocated(spec: SimSpec, steps: int, seed: int) -> Arm:
    return Arm("collocated", simulate_phased(spec, "collocated", steps, seed), "collocated", "static")


def hybrid(spec: SimSpec, steps: int, seed: int) -> Arm:
    p = spec.params
    lcm = math.lcm(p.rollout_tp, p.actor_tp, p.inference_tp)
    shared_min = max(p.min_actor_devices, p.actor_tp, p.inference_tp)
    sizes = [r for r in range(p.rollout_tp, spec.num_devices - shared_min + 1, p.rollout_tp)
             if (spec.num_devices - r) % lcm == 0]
    if not sizes:
        raise TidalError("devices", spec.num_devices, "leave no hybrid split", "use more devices")
    step = max(1, len(sizes) // 16)
    res = {r: simulate_phased(spec, "hybrid", steps, seed, rollout_devices=r) for r in sizes[::step]}
    r = min(res, key=lambda k: res[k].mean_step_s)
    return Arm("hybrid", res[r], f"hybrid: rollout {r}, actor + inference {spec.num_devices - r}", "static")


def best_static(spec: SimSpec, steps: int, seed: int) -> tuple[Arm, Split]:
    results: dict[Split, SimResult] = {}

    def score(s: Split) -> float:
        results[s] = simulate(with_split(spec, s), "static", None, steps, seed, keep_events=False)
        return results[s].mean_step_s
    split, _ = search(spec, score, default_split(spec))
    return Arm("static", results[split], describe_split(split), "static"), split


def rlinf(spec: SimSpec, steps: int, seed: int, static_split: Split) -> Arm:
    best: Arm | None = None
    for split in dict.fromkeys((default_split(spec), static_split)):
        for flags in ((False, False), (True, True)):
            sp = with_split(spec, split)
            sp = replace(sp, params=replace(sp.params, use_pre_process_policy=flags[0],
                                            use_wait_before_last_iter_policy=flags[1]))
            r = simulate(sp, "rlinf", None, steps, seed, keep_events=False)
            if best is None or r.mean_step_s < best.mean_step_s:
                best = Arm("rlinf", r, describe_split(split), "rlinf" + (" (both flags)" if flags[0] else ""))
    assert best is not None
    return best


def baselines(spec: SimSpec, steps: int, seed: int) -> tuple[dict[str, Arm], Split]:
    """Every baseline at its best on `spec` (module doc), and the best static split."""
    static, split = best_static(spec, steps, seed)
    return {"collocated": collocated(spec, steps, seed), "hybrid": hybrid(spec, steps, seed), "static": static,
            "rlinf": rlinf(spec, steps, seed, split)}, split
