"""benchmarks/e2e.py's fitted prediction: the scoring cost from the static run, and the simulator run on the
benchmark's own workload with the fitted costs for every policy label (variants too)."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from scheduler.costs_cpu import calibrate, cpu_e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("e2e_bench_fit", ROOT / "benchmarks" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def args(e2e) -> argparse.Namespace:
    return argparse.Namespace(**{**e2e.FULL, "seed": 0, "share": 0.125, "share_period_ms": 50.0,
                                 "device_cores": None, "max_running": 16})


def test_score_group_seconds_come_from_the_static_runs_inference_phase(e2e):
    steps = [{"phase_seconds": {"inference": 9.0}}, {"phase_seconds": {"inference": 2.0}},
             {"phase_seconds": {"inference": 4.0}}]
    assert e2e.score_group_s(steps, 32) == pytest.approx(3.0 / 32)   # step 0 (warm-up) left out
    assert e2e.score_group_s([], 32) == 0.0 and e2e.score_group_s(steps, 0) == 0.0


def test_prediction_simulates_every_label_with_the_fitted_costs(e2e, tmp_path):
    decode = [(b, 0.015) for b in (1, 8, 16, 32, 64)]
    iters = [(dp, 0.26 + 1.0 / dp) for dp in (2, 4, 6, 8)]
    costs = calibrate(cpu_e2e(), decode, 2e-4, iters, 1867.0, {"reshard": [0.05], "migration": [0.03]}, 8,
                      0.06, 228.0)
    labels = ["static", "rlinf", "tidal", "tidal+margin_s=1000"]
    measured = dict.fromkeys(labels, 4.0)
    out = e2e.predicted(costs, labels, args(e2e), tmp_path, measured, seeds=(0,), steps=2)
    assert list(out) == labels
    for v in out.values():
        assert v["simulated_step_s"] > 0
        assert v["measured_over_simulated"] == pytest.approx(4.0 / v["simulated_step_s"])
    # the policies differ in the simulator as they do on the machine; a margin no move can beat keeps tidal static
    assert out["tidal"]["simulated_step_s"] < out["static"]["simulated_step_s"]
    assert out["tidal+margin_s=1000"]["simulated_step_s"] == pytest.approx(out["static"]["simulated_step_s"])


def test_table_reports_the_drivers_action_seconds_and_reads_older_results(e2e, capsys, monkeypatch):
    import json
    monkeypatch.setenv("COLUMNS", "400")   # rich would elide the columns at a terminal's 80
    old = json.loads((ROOT / "benchmarks" / "results" / "e2e" / "2026-11-30_4553f7e_host16.json").read_text())
    e2e.table(old)   # written before action_s existed: the column reads 0.00
    step = {"seconds": 3.0, "pumps": 100.0}
    run = {"step_s": 3.0, "idle_fraction": 0.3, "reshards": 3, "migrations": 9, "failed_actions": 0,
           "action_s": 0.41, "steps": [step, step]}
    e2e.table({"config": old["config"], "runs": {"static": {**run, "action_s": 0.0}, "tidal": run}})
    out = capsys.readouterr().out
    assert "actions" in out and "0.41" in out and "measured vs simulated" in out


def test_event_summary_prices_actions_per_step_and_iters_per_dp(e2e):
    ev = [{"kind": "action", "step": 0, "action": "MigrateBatch", "seconds": 9.0},   # warm-up step: left out
          {"kind": "action", "step": 1, "action": "MigrateBatch", "seconds": 0.1},
          {"kind": "action", "step": 2, "action": "MigrateBatch", "seconds": 0.3},
          {"kind": "action", "step": 2, "action": "ReshardActor", "seconds": 0.05},
          {"kind": "iter", "step": 1, "dp": 2, "seconds": 0.6, "phases_s": {"compute": 0.5, "sync": 0.1}},
          {"kind": "iter", "step": 2, "dp": 2, "seconds": 0.8, "phases_s": {"compute": 0.6, "sync": 0.2}},
          {"kind": "iter", "step": 2, "dp": 8, "seconds": 0.3, "phases_s": {"compute": 0.2, "sync": 0.1}}]
    out = e2e.event_summary(ev, steps=3)
    assert out["actions"]["MigrateBatch"] == {"per_step": 1.0, "seconds_per_step": pytest.approx(0.2),
                                              "median_s": pytest.approx(0.2)}
    assert out["actions"]["ReshardActor"]["per_step"] == 0.5
    assert out["iters"][2] == {"count": 2, "median_s": pytest.approx(0.7), "compute_s": pytest.approx(0.55),
                               "sync_s": pytest.approx(0.15)}
    assert out["iters"][8]["count"] == 1


def test_event_summary_counts_a_migration_wave_once_and_reports_reshard_phases(e2e):
    wave = {"kind": "migration", "step": 1, "time": 5.0, "seconds": 0.05, "wave": 2,
            "phases_s": {"drain": 0.01, "fetch": 0.02, "import": 0.005}}
    ev = [wave, {**wave, "src": 3},   # two moves of one wave
          {**wave, "time": 7.0, "seconds": 0.15, "phases_s": {"drain": 0.03, "fetch": 0.1, "import": 0.01}},
          {"kind": "reshard", "step": 1, "seconds": 0.06, "worker_s": 0.03, "idle_s": 0.0, "prepare_s": 0.01,
           "phases_s": {"vote": 0.005, "transfer": 0.02}}]
    out = e2e.event_summary(ev, steps=2)
    assert out["migration_waves"] == {"count": 2, "seconds": pytest.approx(0.1), "moves": 2,
                                      "drain": pytest.approx(0.02), "fetch": pytest.approx(0.06),
                                      "import": pytest.approx(0.0075)}
    assert out["reshards"]["count"] == 1 and out["reshards"]["vote"] == 0.005 and out["reshards"]["prepare_s"] == 0.01
    assert e2e.event_summary([], steps=2)["reshards"] == {"count": 0}


def test_event_summary_reports_when_iter_0_could_start_and_the_weight_syncs(e2e):
    def at(g, s, st):
        return {"generated": g, "scored": s, "started": st}

    ev = [{"kind": "iter", "step": 1, "iter": 0, "dp": 4, "seconds": 0.4, "at_s": at(0.9, 1.0, 1.1)},
          {"kind": "iter", "step": 1, "iter": 1, "dp": 4, "seconds": 0.4, "at_s": at(1.2, 1.3, 1.5)},
          {"kind": "iter", "step": 2, "iter": 0, "dp": 4, "seconds": 0.4, "at_s": at(1.1, 1.2, 1.3)},
          {"kind": "weight_sync", "step": 1, "seconds": 0.02, "local": [2, 3, 4, 5, 6, 7], "remote": []},
          {"kind": "weight_sync", "step": 2, "seconds": 0.1, "local": [5], "remote": [2, 3, 4, 6, 7]},
          {"kind": "weight_sync", "step": 0, "version": 1, "tensors": 39}]   # warm-up step: left out
    out = e2e.event_summary(ev, steps=3)
    assert out["first_iter_at_s"] == {"count": 2, "generated": pytest.approx(1.0), "scored": pytest.approx(1.1),
                                      "started": pytest.approx(1.2)}
    assert out["weight_syncs"] == {"count": 2, "seconds": pytest.approx(0.06), "local": 3.5, "remote": 2.5}
