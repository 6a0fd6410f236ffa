"""What a run logs besides its components' metrics: per-step event aggregates (one value per metric and step), the
events table's columns, the devices per component over wall time, and the timeline picture's steps and time
origin. The last test runs a small dynamic run into a real local MLflow store and reads it back."""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tidal.core.devices import DeviceLedger, IllegalTransition, Owner
from tidal.pipeline.run_metrics import placement_changes, step_event_metrics, table_fields
from tidal.pipeline.timeline import Timeline

pytestmark = pytest.mark.usefixtures("shared_ray")

REPO = Path(__file__).resolve().parents[1]
#: a small disaggregated run: actor on 2 devices, rollout on 4, inference on 2 (tests/test_pipeline.py's)
TINY = {
    "run": {"num_steps": 2, "seed": 3},
    "cluster": {"num_devices_per_node": 8, "component_placement": {"actor": "0-1", "rollout": "2-5",
                                                                    "inference": "6-7"}},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 16, "max_running_requests": 16},
    "algorithm": {"group_size": 4, "n_minibatches": 4},
    "data": {"rollout_batch_size": 16, "eval_size": 16},
    "warm_start": {"iters": 0},
}

# events as the pipeline records them (`Cluster.record`), one step's worth
RESHARD = {"kind": "reshard", "time": 7.79, "step": 1, "iter": 0, "from_layout": "tp=1,dp=2,devices=0-1",
           "to_layout": "tp=1,dp=1,devices=0", "bytes_moved": 1000, "seconds": 0.25, "worker_s": 0.1,
           "phases_s": {"transfer": 0.05}, "idle_s": 0.0, "devices": [0], "scope": "members"}
EVENTS = [
    RESHARD,
    {**RESHARD, "time": 9.0, "iter": 2, "bytes_moved": 3000, "seconds": 0.5, "devices": [0, 1]},
    # one wave of two moves: each event carries the wave's 0.4 s
    {"kind": "migration", "time": 8.0, "step": 1, "src": 2, "dst": 4, "groups": 2, "requests": 4, "kv_bytes": 100,
     "mode": "kv", "seconds": 0.4, "wave": 2, "wave_first": True},
    {"kind": "migration", "time": 8.0, "step": 1, "src": 3, "dst": 4, "groups": 1, "requests": 2, "kv_bytes": 50,
     "mode": "kv", "seconds": 0.4, "wave": 2, "wave_first": False},
    {"kind": "action", "time": 7.5, "step": 1, "iter": 1, "action": "ReleaseInference", "reason": "scored",
     "ok": True, "error": "", "seconds": 0.01, "devices": [6, 7]},
    {"kind": "decision", "time": 7.49, "step": 1, "iter": 1, "trigger": "boundary", "decide_s": 0.001,
     "actions": ["ReleaseInference devices [6, 7]: scored"], "seen": {"running": 0}},
    {"kind": "weight_sync", "time": 9.5, "step": 1, "version": 2, "seconds": 0.05, "local": [0], "remote": [2, 3]},
    {"kind": "learn", "time": 9.6, "step": 1, "decode_step_s": 0.15, "score_samples": 9, "iter_samples": [[1, 2]]},
]


def test_step_event_metrics_are_counts_and_totals_once_per_step():
    m = step_event_metrics(EVENTS)
    assert m == pytest.approx({
        "reshard/count": 2, "reshard/total_s": 0.75, "reshard/total_bytes": 4000,
        "migration/count": 2, "migration/total_s": 0.4, "migration/total_bytes": 150,
        "migration/total_groups": 3, "migration/total_requests": 6,
        "action/count": 1, "action/total_s": 0.01,
        "decision/count": 1, "weight_sync/count": 1, "weight_sync/total_s": 0.05, "learn/count": 1})
    # ids, layouts, versions, timestamps, per-event phases and estimates are never metrics
    assert not [k for k in m if re.search(r"version|time$|layout|iter|src|dst|phases|decode_step|worker_s", k)]
    # a step without a reshard, migration or action still has their points (zero), so the charts do not skip it
    assert step_event_metrics([]) == {"reshard/count": 0.0, "reshard/total_s": 0.0, "reshard/total_bytes": 0.0,
                                      "migration/count": 0.0, "migration/total_s": 0.0,
                                      "migration/total_bytes": 0.0, "action/count": 0.0, "action/total_s": 0.0}


def test_table_fields_fill_the_events_table_columns():
    r = table_fields(RESHARD)
    assert (r["component"], r["from"], r["to"], r["bytes"], r["devices"]) == (
        "actor", "tp=1,dp=2,devices=0-1", "tp=1,dp=1,devices=0", 1000, "0")
    assert "from_layout" not in r and "bytes_moved" not in r and r["phases_s"] == {"transfer": 0.05}
    mig, act, dec, sync = (table_fields(EVENTS[i]) for i in (2, 4, 5, 6))
    assert (mig["component"], mig["from"], mig["to"], mig["what"], mig["bytes"]) == (
        "rollout", "instance 2", "instance 4", "kv", 100)
    assert (act["component"], act["what"], act["from"], act["to"], act["devices"], act["ok"]) == (
        "inference", "ReleaseInference", "inference", "free", "6,7", True)
    assert (dec["component"], dec["what"], dec["reason"]) == ("scheduler", "boundary",
                                                              "ReleaseInference devices [6, 7]: scored")
    assert (sync["component"], sync["devices"]) == ("rollout+inference", "0,2,3")
    assert EVENTS[0]["from_layout"] == "tp=1,dp=2,devices=0-1"   # the pipeline's record is left as it was


def test_placement_changes_give_the_counts_that_changed_at_each_move():
    now = [0.0]
    ledger = DeviceLedger(range(4), clock=lambda: now[0])
    ledger.assign_many({Owner.ACTOR: [0, 1], Owner.ROLLOUT: [2, 3]}, "placement")   # one move, one clock reading
    with pytest.raises(IllegalTransition):   # all or nothing: device 0 is no longer free
        ledger.assign_many({Owner.INFERENCE: [0]}, "again")
    now[0] = 2.0
    ledger.release([3], "rollout drained")
    now[0] = 2.5
    ledger.land([3], Owner.ACTOR, "actor grows")
    assert placement_changes(ledger.history, 4) == [
        (0.0, {"free": 0, "actor": 2, "rollout": 2}),
        (2.0, {"rollout": 1, "moving": 1}),
        (2.5, {"moving": 0, "actor": 3})]


def test_timeline_marks_step_starts_and_names_its_time_origin(tmp_path):
    tl = Timeline()
    tl.add_owned([0, 1], "actor", 0.0, 6.0)
    tl.add_busy([0], "actor", "iter", 1.0, 2.0)
    tl.mark_step(0, 0.5)
    tl.mark_step(1, 3.25)
    origin = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC).timestamp()
    fig = tl.figure("t", origin=origin)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "seconds since run start (2026-12-03T10:00:00+00:00)"
    assert [line.get_xdata()[0] for line in ax.get_lines()] == [0.5, 3.25]   # a vertical line per step start
    assert [t.get_text() for t in ax.texts] == ["step 0", "step 1"]
    assert Timeline().figure().axes[0].get_xlabel() == "seconds since run start"
    tl.draw(tmp_path / "timeline.png", origin=origin)
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert tl.to_json()["steps"] == [{"step": 0, "t0": 0.5}, {"step": 1, "t0": 3.25}]


def documented_metrics() -> list[re.Pattern]:
    """The metric names of docs/platform.md's table, `<...>` parts as wildcards."""
    text = (REPO / "docs" / "platform.md").read_text()
    table = text[text.index("### Metrics and their units"):]
    names = [n for cell in re.findall(r"^\| (`[^|]+) \|", table, flags=re.M) for n in re.findall(r"`([^`]+)`", cell)]
    assert names
    return [re.compile(re.sub(r"<[a-z_]+>", "[a-z0-9_]+", re.escape(n)) + "$") for n in names]


@pytest.mark.slow
def test_a_run_in_mlflow_logs_documented_metrics_one_value_per_step_and_the_placement_over_time(tmp_path):
    """A small dynamic run (8 CPU virtual devices, the tidal policy) into a real local MLflow store."""
    from mlflow.tracking import MlflowClient

    from tidal.core.config import build_config, flatten
    from tidal.pipeline.run import TrainingRun
    from tidal.tracking import EVENTS_TABLE, MlflowSink

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    cfg = build_config(TINY, [f"run.output_dir={tmp_path}", "run.name=units", "cluster.auto_scheduler=true",
                              "scheduler.policy=tidal"])
    sink = MlflowSink(uri, "units", str(tmp_path / "art"))
    run_id = sink.start_run("units", flatten(cfg))
    run = TrainingRun(cfg, tmp_path / "units", sink)
    try:
        run.open()
        for _ in range(2):
            run.step()
        run.finish()
    finally:
        run.close()
    sink.end_run()

    client = MlflowClient(tracking_uri=uri)
    names = sorted(client.get_run(run_id).data.metrics)
    patterns = documented_metrics()
    assert [n for n in names if not any(p.match(n) for p in patterns)] == [], "add them to docs/platform.md"
    for name in names:
        hist = client.get_metric_history(run_id, name)
        if name.startswith("devices/"):
            continue
        per_step = Counter(m.step for m in hist)
        assert max(per_step.values()) == 1, (name, per_step)   # no sawtooth: one value per step
    assert {"reshard/count", "phase/actor_device_s", "step/time_s", "devices/actor"} <= set(names)
    # an iter's token means, averaged over the step's 4 iters (not summed): a fraction stays one, a ratio near 1
    final = client.get_run(run_id).data.metrics
    assert 0.0 <= final["grpo/clip_frac"] <= 1.0 and 0.5 < final["grpo/ratio_mean"] < 1.5, final

    # devices per component: a value at each change, at the change's wall time, inside the run
    info = client.get_run(run_id).info
    series = {n: client.get_metric_history(run_id, n) for n in names if n.startswith("devices/")}
    stamps = sorted(m.timestamp for h in series.values() for m in h)
    assert info.start_time <= stamps[0] and stamps[-1] <= info.end_time
    for h in series.values():   # one value per instant: no spike at a millisecond holding several moves
        assert len({m.timestamp for m in h}) == len(h)
    first = {n: min(h, key=lambda m: m.timestamp).value for n, h in series.items()}
    assert (first["devices/actor"], first["devices/rollout"], first["devices/inference"], first["devices/free"]) \
        == (2, 4, 2, 0)

    table = json.loads(Path(client.download_artifacts(run_id, EVENTS_TABLE, str(tmp_path))).read_text())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    reshards = [r for r in rows if r["kind"] == "reshard"]
    assert sum(m.value for m in client.get_metric_history(run_id, "reshard/count")) == len(reshards)
    assert all(r["component"] == "actor" and r["from"].startswith("tp=") and r["bytes"] > 0 for r in reshards)
    assert all(r["step"] in (0, 1) for r in rows)
