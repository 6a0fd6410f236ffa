"""What the reconciler learns between steps from its own measurements (scheduler/costs.py): the decode step time,
the scoring cost per group, the reshard fixed cost and the move costs (migration batch, lend, return), each
replacing the preset's value in `SchedState.costs`;
and how far the rollout-time model is off (`SchedState.rollout_time_factor`)."""

import dataclasses

import pytest

from scheduler.costs import (
    learn_actor_factor,
    learn_decode,
    learn_moves,
    learn_reshard,
    learn_rollout_factor,
    learn_scoring,
)
from scheduler.costs_cpu import cpu_e2e


def test_decode_step_is_the_median_residual_and_keeps_the_slope():
    prior = cpu_e2e().decode
    samples = [(16.0, 0.06)] * 9 + [(16.0, 5.0)]   # one call stalled by the machine: the median ignores it
    got = learn_decode(samples, prior)
    assert got.step_s == pytest.approx(0.06 - prior.per_seq_s * 16)
    assert (got.per_seq_s, got.prefill_per_token_s) == (prior.per_seq_s, prior.prefill_per_token_s)


def test_decode_needs_enough_samples():
    assert learn_decode([(16.0, 0.06)] * 7, cpu_e2e().decode) is None
    assert learn_decode([(16.0, 0.0)] * 9, cpu_e2e().decode) is None   # no positive timings: nothing to say


def test_reshard_fixed_cost_net_of_the_modelled_transfer():
    prior = cpu_e2e().reshard
    ev = [{"kind": "reshard", "seconds": 1.2, "bytes_moved": 4e8, "devices": [0, 1, 2, 3]},   # 0.1 s of bytes
          {"kind": "reshard", "seconds": 0.4, "bytes_moved": 0, "devices": [0, 1]},
          {"kind": "reshard", "seconds": 0.8, "bytes_moved": 2e8, "devices": [0, 1]},        # 0.1 s
          {"kind": "migration", "seconds": 9.0}]
    got = learn_reshard(ev, prior)
    assert got.fixed_s == pytest.approx(0.7)   # median of 1.1, 0.4, 0.7
    assert got.bw == prior.bw and learn_reshard(ev[3:], prior) is None


def test_move_costs_are_the_median_measured_actions_net_of_the_kv_bytes():
    prior = cpu_e2e()

    def act(name, s, **kw):
        return {"kind": "action", "action": name, "seconds": s, "ok": True, **kw}

    ev = [act("MigrateBatch", 0.05, kv_bytes=0), act("MigrateBatch", 0.09, kv_bytes=2e7),   # 0.02 s of bytes
          act("MigrateBatch", 3.0, kv_bytes=0, ok=False),   # a failed action prices nothing
          act("MigrateRequests", 0.08, kv_bytes=0), act("LendToRollout", 0.02), act("ReturnFromRollout", 0.01),
          act("ReshardActor", 0.4), {"kind": "reshard", "seconds": 0.4}]
    got = learn_moves(ev, prior, kv=True)
    assert got.kv_fixed_s == pytest.approx(0.07)     # median of 0.05, 0.07, 0.08
    assert (got.lend_s, got.return_s) == (0.02, 0.01)
    assert got.migration_fixed_s == prior.migration_fixed_s and got.reshard == prior.reshard
    # an engine without KV moves re-prefills: the batch prices the abort + resubmit round trip instead
    got = learn_moves(ev, prior, kv=False)
    assert got.migration_fixed_s == pytest.approx(0.08) and got.kv_fixed_s == prior.kv_fixed_s
    # only what was measured changes; nothing measured: None
    only_lend = learn_moves([act("LendInference", 0.3)], prior, kv=True)
    assert (only_lend.lend_s, only_lend.kv_fixed_s, only_lend.return_s) == (0.3, prior.kv_fixed_s, prior.return_s)
    assert learn_moves([act("ReshardActor", 0.4)], prior, kv=True) is None


def test_scoring_cost_per_group_is_the_median_residual_and_keeps_the_slope():
    prior = dataclasses.replace(cpu_e2e().inference, per_token_s=2e-4)   # the residual below stays positive
    tok = 8 * (12 + 20)   # a group: 8 samples of 12 prompt + 20 response tokens
    samples = [(2, 2 * tok, 0.30)] * 4 + [(1, tok, 0.15), (2, 2 * tok, 4.0)]   # one call stalled: ignored
    got = learn_scoring(samples, prior)
    assert got.per_group_s == pytest.approx(0.15 - prior.per_token_s * tok)
    assert got.per_token_s == prior.per_token_s
    # what the policy then predicts for a group is what the driver saw
    assert got.group_time(tok, 1) == pytest.approx(0.15)
    assert learn_scoring(samples[:3], prior) is None


def test_rollout_factor_is_the_median_measured_over_modelled_time_left():
    # rollout ended at t = 10; notes (when, modelled seconds left): the model said half of what it took
    notes = [(2.0, 4.0), (4.0, 3.0), (6.0, 2.0), (9.0, 5.0), (11.0, 1.0)]   # the last one is after the end
    assert learn_rollout_factor(notes, 10.0) == pytest.approx(2.0)          # median of 2, 2, 2, 0.2
    assert learn_rollout_factor([(0.0, 0.1)] * 3, 10.0) == 4.0              # clipped: a stall teaches little
    assert learn_rollout_factor(notes[:2], 10.0) is None


def test_actor_factor_scales_the_model_keeping_its_layout_scaling():
    prior = cpu_e2e().actor
    slow = [(1, dp, 1800.0, 1.6 * prior.iter_time(1800.0, 1, dp)) for dp in (2, 2, 2)]
    slow.append((1, 2, 1800.0, 9.0 * prior.iter_time(1800.0, 1, 2)))   # one iter stalled: the median ignores it
    assert learn_actor_factor(slow, prior) == pytest.approx(1.6)
    assert learn_actor_factor(slow[:2], prior) is None
    # a preset from a slower machine: the factor follows it well below 1 (the host's 0.23x was clipped at 0.5)
    fast = [(1, dp, 1800.0, 0.23 * prior.iter_time(1800.0, 1, dp)) for dp in (2, 4, 8)]
    assert learn_actor_factor(fast, prior) == pytest.approx(0.23)
