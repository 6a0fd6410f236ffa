"""The CPU cost model's fit from measured runs: samples made from known parameters give those parameters back."""

import math

import pytest

from scheduler.costs import rank_share
from scheduler.costs_cpu import calibrate, cpu_e2e, event_costs, iter_samples
from tidal.core.errors import TidalError
from tidal.pipeline.timeline import Timeline


def test_calibrate_recovers_decode_actor_and_move_costs():
    base = cpu_e2e()
    decode = [(b, 0.03 + 2e-4 * b) for b in (1, 8, 16, 32, 64)]
    tokens = 1800.0
    iters = [(dp, 0.2 + 1.5 / dp) for dp in (2, 4, 6, 8)]
    moves = {"reshard": [0.3, 0.2, 0.4], "migration": [0.05, 0.07, 0.5], "lend": [0.1], "release": []}
    c = calibrate(base, decode, 1e-3, iters, tokens, moves)
    assert c.decode.step_s == pytest.approx(0.03)
    assert c.decode.per_seq_s == pytest.approx(2e-4)
    assert c.decode.prefill_per_token_s == 1e-3
    assert c.actor.iter_fixed_s == pytest.approx(0.2, abs=0.01)   # less the modelled all-reduce (~6 ms)
    for dp in (2, 8):
        assert c.actor.iter_time(tokens, 1, dp) == pytest.approx(0.2 + 1.5 / dp, rel=1e-3)
    assert c.reshard.fixed_s == 0.3 and c.kv_fixed_s == 0.07 and c.lend_s == 0.1
    assert c.name == "cpu-e2e-fitted"
    assert c.inference == base.inference    # no scoring measured: the preset's
    c = calibrate(base, decode, 1e-3, iters, tokens, moves, score_group_s=0.06, group_tokens=240.0)
    assert c.inference.group_time(240.0, 1) == pytest.approx(0.06)
    assert c.inference.group_time(480.0, 1) == pytest.approx(0.12) and c.inference.per_group_s == 0.0


def test_calibrate_keeps_preset_terms_it_cannot_fit():
    base = cpu_e2e()
    c = calibrate(base, [(1, 0.05), (64, 0.06)], 1e-3, [(2, 1.0), (2, 1.1)], 1800.0, {})
    assert c.actor == base.actor            # one dp only: the actor is not refitted
    assert c.reshard == base.reshard and c.kv_fixed_s == base.kv_fixed_s
    with pytest.raises(TidalError, match="two or more distinct"):
        calibrate(base, [(64, 0.05), (64, 0.06)], 1e-3, [], 1800.0, {})


def test_samples_from_a_runs_timeline_and_events():
    tl = Timeline()
    tl.add_busy([0, 1], "actor", "iter 0", 1.0, 2.1)
    tl.add_busy([0, 1, 2, 3], "actor", "iter 1", 3.0, 3.7)
    tl.add_busy([2], "rollout", "generate", 0.0, 1.0)
    assert sorted(iter_samples(tl)) == [(2, pytest.approx(1.1)), (4, pytest.approx(0.7))]
    events = [{"kind": "reshard", "seconds": 0.2}, {"kind": "migration", "seconds": 0.05},
              {"kind": "action", "action": "StartRollout", "ok": True, "seconds": 0.1},
              {"kind": "action", "action": "LendToRollout", "ok": False, "seconds": 9.0},
              {"kind": "action", "action": "ReleaseRollout", "ok": True, "seconds": 0.01}]
    assert event_costs(events) == {"reshard": [0.2], "migration": [0.05], "lend": [0.1], "release": [0.01]}


def test_actor_iter_follows_whole_micro_batches_per_rank():
    """8 micro-batches per iter: the busiest rank trains ceil(8 / dp) of them, so dp 3 trains 3/8 of the iter
    and dp 5, 6, 7 gain nothing over dp 4. The fit recovers the terms from samples made that way."""
    base = cpu_e2e()
    tokens = 1800.0
    iters = [(dp, 0.5 + 2.4 * math.ceil(8 / dp) / 8) for dp in (2, 3, 4, 6, 8)]
    c = calibrate(base, [(1, 0.1), (64, 0.1)], 1e-3, iters, tokens, {}, micro_batches=8)
    assert c.actor.iter_fixed_s == pytest.approx(0.5, abs=0.01)   # less the modelled all-reduce (~6 ms)
    for dp in (2, 3, 8):
        assert c.actor.iter_time(tokens, 1, dp, 8) == pytest.approx(0.5 + 2.4 * math.ceil(8 / dp) / 8, rel=1e-2)
    a = c.actor
    assert a.iter_time(tokens, 1, 6, 8) == pytest.approx(a.iter_time(tokens, 1, 4, 8), rel=1e-2)
    assert a.iter_time(tokens, 1, 16, 8) == pytest.approx(a.iter_time(tokens, 1, 8, 8), rel=1e-2)
    # unknown micro-batching: the work splits evenly
    assert a.iter_time(tokens, 1, 3) < a.iter_time(tokens, 1, 3, 8)
    assert rank_share(3) == pytest.approx(1 / 3) and rank_share(3, 8) == 3 / 8
    assert [rank_share(dp, 8) for dp in (2, 3, 8)] == [0.5, 0.375, 0.125]
