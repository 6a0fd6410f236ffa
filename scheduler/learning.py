"""What the producer learns from a finished step for the next one's decisions: pure functions of typed records.

    learn_step(state, StepHistory) -> Learned(state, lengths, summary)

- the length model (mean residual and tail of response lengths) from the step's responses;
- the readiness curve: the fraction of rollout time by which k/16 of the groups were generated, read on the
  id-order prefix (what the actor waits for), not on the count;
- the costs it measured (decode step, scoring, reshards, migrations, lends, returns: `scheduler.costs.learn_*`)
  and the factors by which the cost model mispredicted the remaining rollout and the actor's iters.

The simulator's cost model is its ground truth, so it learns only the workload's shape (length model and
readiness curve) with the same `ready_curve` and `LengthModel.fit`; a real run learns all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from scheduler.costs import (
    learn_actor_factor,
    learn_decode,
    learn_moves,
    learn_reshard,
    learn_rollout_factor,
    learn_scoring,
)
from scheduler.estimate import LengthModel
from scheduler.state import SchedState


def ready_curve(gen_times: np.ndarray, t_start: float) -> tuple[float, ...]:
    """`gen_times[g]`: when group g came back generated (ids in order). The 17 quantiles of when the id prefix
    reached each group, as fractions of the step's rollout span."""
    if not gen_times.size:
        return ()
    t = np.maximum.accumulate(gen_times) - t_start
    span = float(t.max()) if t.max() > 0 else 1.0
    return tuple((np.quantile(t, np.linspace(0, 1, 17)) / span).tolist())


@dataclass(frozen=True)
class RolloutPrediction:
    """What was left of the step's rollout at `time`: tokens, the longest sequence, the instances holding it."""

    time: float
    remaining_tokens: float
    tail_tokens: float
    instances: int


@dataclass(frozen=True)
class StepHistory:
    """What one real step measured (the driver's records)."""

    step: int
    t_start: float
    response_lengths: Sequence[int]
    prompt_lengths: Sequence[int]
    gen_times: np.ndarray                                  #: per group id, in id order
    decode_samples: Sequence[tuple[float, float]]          #: (mean batch, seconds per decode step)
    score_samples: Sequence[tuple[int, float, float]]      #: (groups, tokens, seconds)
    iter_samples: Sequence[tuple[int, int, float, float]]  #: (tp, dp, tokens, seconds)
    events: Sequence[dict[str, Any]]                       #: the step's reshard / migration / lend events
    predictions: Sequence[RolloutPrediction] = field(default_factory=tuple)


@dataclass(frozen=True)
class Learned:
    state: SchedState
    lengths: LengthModel
    summary: dict[str, Any]   #: the "learn" event's fields


def learn_step(state: SchedState, h: StepHistory, max_new_tokens: int, inference_tp: int) -> Learned | None:
    """The next step's scheduler state from this step's history; None when the step produced no response."""
    if not h.response_lengths:
        return None
    lengths = LengthModel.fit(list(h.response_lengths), max_new_tokens)
    costs = state.costs
    dec = learn_decode(h.decode_samples, costs.decode)
    if dec is not None:   # the decode step time this run measured (the preset's is a prior)
        costs = costs.with_decode(dec)
    sc = learn_scoring(h.score_samples, costs.inference, inference_tp)
    if sc is not None:    # and what scoring a group costs as the driver sees it
        costs = replace(costs, inference=sc)
    # priced with the decode cost just learned, so the factor corrects only what the model misses (sequences
    # start in waves, stragglers), not the step time twice
    plain = replace(state, costs=costs, rollout_time_factor=1.0)
    notes = [(p.time, float(plain.decode_seconds(p.remaining_tokens / p.instances, p.tail_tokens)))
             for p in h.predictions]
    rollout_end = float(h.gen_times.max()) if h.gen_times.size else 0.0
    factor = learn_rollout_factor(notes, rollout_end)
    if factor is None:
        factor = state.rollout_time_factor
    actor_factor = learn_actor_factor(h.iter_samples, costs.actor, micro_batches=state.params.micro_batches)
    if actor_factor is None:
        actor_factor = state.actor_time_factor
    res = learn_reshard(h.events, costs.reshard)
    if res is not None:   # and what its reshards really cost, all in
        costs = replace(costs, reshard=res)
    moves = learn_moves(h.events, costs, state.params.kv_migration)
    if moves is not None:  # and its migrations, lends and returns
        costs = moves
    summary = {"decode_step_s": costs.decode.step_s, "reshard_fixed_s": costs.reshard.fixed_s,
               "kv_fixed_s": costs.kv_fixed_s, "migration_fixed_s": costs.migration_fixed_s,
               "lend_s": costs.lend_s, "return_s": costs.return_s,
               "score_group_s": costs.inference.per_group_s, "score_samples": len(h.score_samples),
               "iter_samples": [list(x) for x in h.iter_samples], "rollout_time_factor": factor,
               "actor_time_factor": actor_factor, "decode_samples": len(h.decode_samples),
               "mean_response_tokens": lengths.mean}
    new = replace(state, mean_response_tokens=lengths.mean, prompt_tokens=float(np.mean(h.prompt_lengths)),
                  ready_curve=ready_curve(h.gen_times, h.t_start), costs=costs, rollout_time_factor=factor,
                  actor_time_factor=actor_factor)
    return Learned(new, lengths, summary)
