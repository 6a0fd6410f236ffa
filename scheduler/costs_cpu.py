"""The CPU cost model of the end-to-end benchmark, fitted from measured runs, and the measurements that fit it.

`cpu_tiny()` (costs.py) holds orders of magnitude. `cpu_e2e()` holds what was measured on the e2e workload
(benchmarks/e2e.py: 8 CPU virtual devices pinned to one core at 0.125 core each, hidden 128 x 4 layers,
~0.8M params, max_seq_len 64, 16 running requests per instance); docs/e2e.md gives the fit and its samples.

Measurements (every one on a capped device worker, so the caps and the machine's load are those of the run;
the worker functions are in `tidal.workers.cost_probes`):

    decode step vs batch   `measure_decode` (worker): a NativeEngine with b requests running, seconds per
                           `engine.step()` for several b; `fit_decode` -> step_s + per_seq_s * b.
                           On CPU the engine pads decode rows to 64, so the step cost barely depends on b: an
                           instance's rollout time is set by its longest sequence (decode steps), not its tokens.
    actor iter vs dp       `iter_samples(timeline)`: every "iter k" busy span of a run, dp = devices busy on it;
                           `fit_actor` -> iter_fixed_s + train_per_token_s * tokens / dp (tokens: what the policy
                           counts for an iter, sequences x (prompt + mean response)).
    reshard                `event_costs(events)`: seconds of every `reshard` event -> fixed_s (the bytes are
                           small: time is call round trips and group setup, not bandwidth).
    KV migration           seconds of every `migration` event -> kv_fixed_s (export + import + commit: three
                           calls on capped workers; the KV bytes, ~1 MB, are negligible).
    lend / start rollout   seconds of `LendToRollout` / `StartRollout` actions -> lend_s.

Model forms are those of costs.py; only the numbers differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from scheduler.costs import (
    LEND_ACTIONS,
    ActorCost,
    CostModel,
    DecodeCost,
    InferenceCost,
    ReshardCost,
    fit_actor,
    fit_decode,
)


def cpu_e2e() -> CostModel:
    """Measured on the e2e workload as benchmarks/e2e.py runs it (8 devices pinned to one core at 0.125 core each,
    the driver on the other; docs/e2e.md) on a shared 2-core machine, whose core speed drifts by
    up to 5x within minutes (the online learning rescales these every step):

    - decode: 0.10-0.21 s per step over b in {1, 8, 16, 32, 64}, no trend in b (rows are padded to 64): 0.15 s
      flat; prefill ~1.6 ms per prompt token;
    - inference: 0.13-0.26 s per group of 8 (padded to 64 tokens), as the driver sees a scoring call;
    - actor: one iter's 64 sequences (8 micro-batches of 8) at dp 2/4/6/8: 2.9 / 1.75 / 1.6 / 1.0 s inside the
      worker, ~0.15 s more as the driver sees it. The time follows whole micro-batches per rank (dp 6 is no
      faster than dp 4): 0.5 s + 2.78 ms per token of the busiest rank's share ceil(8 / dp) / 8 of the policy's
      token count (64 x (9 + ~19.5));
    - reshard ~0.3 s (programs planned on the driver, process groups made ahead); KV migration 0.1-0.3 s per
      wave of moves; lend / start ~0.1 s.
    """
    p = 0.8e6
    return CostModel(
        name="cpu-e2e",
        decode=DecodeCost(step_s=0.15, per_seq_s=1e-4, prefill_per_token_s=1.6e-3),
        inference=InferenceCost(per_token_s=6e-4, tp_eff=0.7, per_group_s=0.02),
        actor=ActorCost(train_per_token_s=2.78e-3, iter_fixed_s=0.5, grad_bytes=4 * p, link_bw=1e9, tp_eff=0.7),
        reshard=ReshardCost(param_bytes=4 * p, optim_bytes=12 * p, bw=1e9, inter_node_bw=1e9,
                            devices_per_node=8, fixed_s=0.3),
        migration_fixed_s=0.15, rollout_release_s=0.02, inference_release_s=0.02,
        lend_s=0.1, return_s=0.05, sync_fixed_s=0.1, sync_bw=1e9,
        kv_bytes_per_token=4 * 2 * 64 * 4, kv_bw=1e9, kv_fixed_s=0.15,
    )


# ---- samples from a run's records ------------------------------------------------------------------------
def iter_samples(timeline: Any) -> list[tuple[int, float]]:
    """(dp, seconds) of every actor iter in a run's `Timeline` (dp: devices on the same iter span)."""
    spans: dict[tuple[str, float], list[Any]] = {}
    for s in timeline.busy:
        if s.role == "actor" and s.what.startswith("iter "):
            spans.setdefault((s.what, round(s.t0, 1)), []).append(s)
    return [(len(v), max(x.t1 for x in v) - min(x.t0 for x in v)) for v in spans.values()]


def event_costs(events: Sequence[dict]) -> dict[str, list[float]]:
    """Seconds per kind of move, from a run's events: reshard, migration, and the lend/start actions."""
    out: dict[str, list[float]] = {"reshard": [], "migration": [], "lend": [], "release": []}
    for e in events:
        if e["kind"] == "reshard":
            out["reshard"].append(float(e["seconds"]))
        elif e["kind"] == "migration":
            out["migration"].append(float(e["seconds"]))
        elif e["kind"] == "action" and e.get("ok"):
            if e["action"] in LEND_ACTIONS:
                out["lend"].append(float(e["seconds"]))
            elif e["action"] in ("ReleaseRollout", "ReleaseInference"):
                out["release"].append(float(e["seconds"]))
    return out


def calibrate(base: CostModel, decode: Sequence[tuple[int, float]], prefill_per_token_s: float,
              iters: Sequence[tuple[int, float]], iter_tokens: float, moves: dict[str, list[float]],
              micro_batches: int = 0, score_group_s: float = 0.0, group_tokens: float = 0.0) -> CostModel:
    """`base` with the fitted decode and actor terms and the median measured move costs (where measured);
    `micro_batches` per actor iter (0: unknown) shapes the actor fit like the policy's model. `score_group_s`
    (seconds inference spends on one group of `group_tokens` tokens, 0: not measured) sets the inference cost,
    all of it per token (the policy scores groups of one size)."""
    c = replace(base, name=base.name + "-fitted", decode=fit_decode(decode, prefill_per_token_s))
    if score_group_s > 0 and group_tokens > 0:
        c = replace(c, inference=replace(c.inference, per_token_s=score_group_s / group_tokens, per_group_s=0.0))
    if len({dp for dp, _ in iters}) >= 2:
        c = replace(c, actor=fit_actor(iters, iter_tokens, 1, base.actor, micro_batches))
    med = {k: float(np.median(v)) for k, v in moves.items() if v}
    if "reshard" in med:
        c = replace(c, reshard=replace(c.reshard, fixed_s=med["reshard"]))
    if "migration" in med:
        c = replace(c, kv_fixed_s=med["migration"], migration_fixed_s=med["migration"])
    if "lend" in med:
        c = replace(c, lend_s=med["lend"])
    return c


__all__ = ["cpu_e2e", "iter_samples", "event_costs", "calibrate"]
