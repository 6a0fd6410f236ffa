"""What the reconciler learns between steps from its own measurements (scheduler/costs.py): the decode step time,
the scoring cost per group and the reshard fixed cost, each replacing the preset's value in `SchedState.costs`;
and how far the rollout-time model is off (`SchedState.rollout_time_factor`)."""

import dataclasses

import pytest

from tidal.scheduler.costs import (learn_actor_factor, learn_decode, learn_reshard, learn_rollout_factor,
                                   learn_scoring)
from tidal.scheduler.costs_cpu import cpu_e2e


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
