"""Every baseline in the simulator, at its best, and tidal's planned placement against them.

Collocated and hybrid placements (phases in turn), the best static split by search, rlinf at its best, model shapes
scaled from the measured H200 figures, workloads from files, and `tidal plan`.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from scheduler.baselines import baselines, default_split, search, valid, with_split
from scheduler.catalog import spec as catalog_spec
from scheduler.costs import gpu_h200
from scheduler.costs_h200 import fit
from scheduler.model_costs import SHAPES, costs_for, shape
from scheduler.phased import (
    collocated_step,
    hybrid_step,
    minibatch_ready,
    simulate_phased,
    state_bytes_per_device,
    step_lengths,
)
from scheduler.plan_cli import main as plan_main
from scheduler.plan_cli import report
from scheduler.planner import plan, run_candidate
from scheduler.simulator import simulate
from scheduler.workload import EmpiricalLengths
from tidal.core.errors import TidalError


@pytest.fixture(scope="module")
def longtail8():
    return catalog_spec("longtail", "1.5b", 8)


def test_scaling_is_the_identity_at_the_measured_shape():
    """The 1.5B shape at the fit's 1,024-token context costs what the H200 preset measured."""
    mine, measured = costs_for(shape("1.5b"), 1024 - 0.0), gpu_h200()
    assert mine.decode.step_s == pytest.approx(measured.decode.step_s, rel=1e-9)
    assert mine.decode.per_seq_s == pytest.approx(measured.decode.per_seq_s, rel=1e-9)
    for a, b in ((mine.actor.train_per_token_s, measured.actor.train_per_token_s),
                 (mine.inference.per_token_s, measured.inference.per_token_s),
                 (mine.reshard.param_bytes, measured.reshard.param_bytes),
                 (mine.decode.prefill_per_token_s, measured.decode.prefill_per_token_s)):
        assert a == pytest.approx(b, rel=1e-9)
    big = costs_for(shape("32b"), 1024)
    assert big.actor.train_per_token_s > 20 * measured.actor.train_per_token_s
    assert big.decode.step_s > measured.decode.step_s   # 21x the weights over TP 2, 2.3x the layers


def test_the_actors_memory_floor_is_kept_by_splits_and_by_tidal_sizes():
    assert [SHAPES[m].min_actor_devices for m in ("1.5b", "7b", "32b")] == [1, 4, 16]
    s = catalog_spec("math", "7b", 8)
    assert s.params.min_actor_devices == 4 and len(s.params.actor_devices) >= 4
    assert min(s.params.tidal_sizes()) == 4
    assert not valid(s, (2, 4, 2)) and valid(s, (4, 2, 2))
    with pytest.raises(TidalError, match="devices"):
        catalog_spec("math", "32b", 8)


def test_collocated_step_is_its_phases_in_turn_and_its_hand_over_is_the_measured_one(longtail8):
    lengths = step_lengths(longtail8, 0, 0)
    ph = collocated_step(longtail8, lengths)
    assert ph.total == pytest.approx(ph.rollout + ph.scoring + ph.training + ph.handover + ph.sync)
    assert min(ph.rollout, ph.scoring, ph.training, ph.handover, ph.sync) > 0
    # one device holds the whole state: its hand-over is the offload + onload measured on one H200
    f = fit()
    one = dataclasses.replace(longtail8, costs=gpu_h200())
    state = state_bytes_per_device(one, 1)
    assert state == pytest.approx(14 * 1.54e9)
    assert one.costs.offload_s(state) + one.costs.onload_s(state) == pytest.approx(f.offload_s + f.onload_s,
                                                                                   rel=0.01)
    # the simulator's draws: a phased run and a dynamic run see the same lengths step for step
    res = simulate_phased(longtail8, "collocated", 2, 0)
    assert res.steps[0].time_s == pytest.approx(ph.total)


def test_hybrid_trains_after_its_scores_and_takes_turns(longtail8):
    lengths = step_lengths(longtail8, 0, 0)
    few, many = hybrid_step(longtail8, lengths, 2), hybrid_step(longtail8, lengths, 6)
    for ph in (few, many):
        assert ph.total >= ph.rollout + ph.sync
        assert ph.handover > 0 and ph.training > 0
    assert many.rollout < few.rollout           # more devices generate faster
    assert many.training > few.training         # and fewer are left to train
    with pytest.raises(TidalError, match="hybrid split"):
        hybrid_step(longtail8, lengths, 8)


def test_search_finds_the_best_split_on_the_grid_and_by_moves():
    s = catalog_spec("gsm8k", "1.5b", 64)
    target = (20, 36, 8)
    calls: list = []

    def score(split):
        calls.append(split)
        return float(sum(abs(a - b) for a, b in zip(split, target)))
    best, val = search(s, score, default_split(s))
    assert best == target and val == 0.0
    assert all(valid(s, c) for c in calls) and len(set(calls)) == len(calls)   # each split scored once
    assert len(calls) < 200


def test_best_static_beats_every_split_on_its_grid_and_rlinf_is_its_best_variant(longtail8):
    arms, split = baselines(longtail8, 2, 0)
    assert arms["static"].result.policy == "static" and valid(longtail8, split)
    for s in ((2, 4, 2), (4, 2, 2), (1, 6, 1), (3, 4, 1)):
        r = simulate(with_split(longtail8, s), "static", None, 2, 0, keep_events=False)
        assert arms["static"].mean_step_s <= r.mean_step_s + 1e-9
    plain = simulate(with_split(longtail8, default_split(longtail8)), "rlinf", None, 2, 0, keep_events=False)
    assert arms["rlinf"].mean_step_s <= plain.mean_step_s + 1e-9


@pytest.mark.parametrize("model", ["1.5b", "7b"])
def test_tidal_is_at_least_as_fast_as_every_baseline(model):
    """The planned placement, chosen on other draws of the workload, against every baseline at its best on the
    draws it is scored on."""
    rep = report(catalog_spec("longtail", model, 8), 2)
    assert rep["tidal_vs_best_baseline"] >= 1.0 - 1e-9
    for name in ("collocated", "hybrid", "static", "rlinf"):
        assert rep["arms"][name]["tidal_speedup"] >= 1.0 - 1e-9, name
    assert rep["arms"]["tidal"]["placement"] == rep["plan"]["chosen"]
    assert len(rep["minibatch_ready_fraction"]) == 4
    # the bound holds under every schedule the simulator runs on the same draws, dynamic ones included
    assert all(a["step_s"] >= rep["bound_s"] for a in rep["arms"].values())
    assert rep["collocated_over_bound"] >= 1.0


def test_the_plan_takes_a_dynamic_split_when_the_hand_over_is_dear(longtail8):
    dear = dataclasses.replace(longtail8, costs=dataclasses.replace(longtail8.costs, offload_bw=2e8, onload_bw=2e8))
    cheap = plan(longtail8, 1)
    assert cheap.chosen.placement == "collocated"   # the measured hand-over is under a second
    p = plan(dear, 1)
    assert p.chosen.policy == "tidal" and p.chosen.split is not None
    assert p.chosen.predicted_step_s == min(c.predicted_step_s for c in p.candidates)
    assert "faster than the next best" in p.reason
    scored = run_candidate(dear, p.chosen, 1, 0)
    assert scored.mean_step_s < simulate_phased(dear, "collocated", 1, 0).mean_step_s


def test_mini_batches_in_id_order_are_generated_with_the_tail(longtail8):
    """Why streaming the actor buys little on these workloads: every id-order mini-batch holds a sequence of the
    tail, so each is generated near the rollout's end."""
    ready = minibatch_ready(longtail8, step_lengths(longtail8, 0, 0), 8)
    assert ready == sorted(ready) and ready[-1] == 1.0 and ready[0] > 0.8


def test_lengths_from_a_file(tmp_path):
    flat, grouped = tmp_path / "flat.json", tmp_path / "groups.json"
    flat.write_text(json.dumps([100, 200, 300, 50_000]))
    grouped.write_text(json.dumps({"groups": [[10, 12], [4000, 9000, 8000]]}))
    rng = np.random.default_rng(0)
    x = EmpiricalLengths.from_file(flat).sample(rng, 64, 4, 16384)
    assert x.shape == (64, 4) and set(np.unique(x)) <= {100, 200, 300, 16384}
    g = EmpiricalLengths.from_file(grouped).sample(rng, 200, 3, 16384)
    short = g.max(axis=1) <= 12
    assert short.any() and (~short).any() and (g[short] <= 12).all() and (g[~short] >= 4000).all()
    for text, why in (("{", "is not JSON"), ("[]", "holds no lengths"), ("[1, -2]", "integer lengths"),
                      ('[[1], "x"]', "integer lengths")):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(TidalError, match=why) as e:
            EmpiricalLengths.from_file(bad)
        assert "--lengths" in str(e.value)
    with pytest.raises(TidalError, match="cannot be read"):
        EmpiricalLengths.from_file(tmp_path / "missing.json")
    run = tmp_path / "run"   # a finished run's folder: every group of every step
    run.mkdir()
    with pytest.raises(TidalError, match="not a finished run's folder"):
        EmpiricalLengths.from_file(run)
    (run / "steps.json").write_text(json.dumps([{"response_lengths": [[3, 5], [7, 0]]},
                                                {"response_lengths": [[9, 9]]}]))
    assert EmpiricalLengths.from_file(run).groups == ((3, 5), (7, 0), (9, 9))


def test_tidal_plan_on_a_workload_and_on_a_config(tmp_path, capsys):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([[300, 500, 800, 16384]] * 4 + [[200, 250, 300, 280]] * 12))
    out = tmp_path / "plan.json"
    assert plan_main(["--workload", "longtail", "--model", "1.5b", "--devices", "8", "--lengths", str(lengths),
                      "--steps", "1", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert set(rep["arms"]) == {"collocated", "hybrid", "static", "rlinf", "tidal"}
    assert "recommended:" in capsys.readouterr().out
    assert plan_main(["experiments/tiny_dynamic.yaml", "--steps", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["devices"] == 4
    with pytest.raises(TidalError, match="no config"):
        plan_main(["--workload", "longtail"])
