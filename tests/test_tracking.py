"""MlflowSink against a real MLflow SQLite store (no server), read back with MlflowClient; NullSink; compare."""

from __future__ import annotations

import json
import posixpath
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.core.config import build_config, flatten
from tidal.core.errors import TidalError
from tidal.tracking import CompareRow, MetricsSink, MlflowSink, NullSink, compare_runs, sanitize_key, tracked_run


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlruns.db'}"
    cfg = build_config({"tracking": {"mlflow_uri": uri, "mlflow_artifacts": str(root / "artifacts"),
                                     "experiment": "test-exp"}})
    sink = MlflowSink.from_config(cfg.tracking, flush_every_s=3600)
    return root, uri, cfg, sink


def _client(uri):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=uri)


@pytest.mark.parametrize("key,expected", [
    ("reshard/bytes", "reshard/bytes"),
    ("sched/idle_gpu_s", "sched/idle_gpu_s"),
    ("a//b", "a/b"),
    ("/lead/trail/", "lead/trail"),
    ("x/./y/../z", "x/y/_/z"),
    ("loss[actor]@dp=2", "loss_actor__dp_2"),
    ("", "_"),
    ("ä/ß", "ä/ß"),  # \w is unicode in Python and in MLflow's own check
])
def test_sanitize_key(key, expected):
    assert sanitize_key(key) == expected


def test_sanitize_key_length_and_path_rule():
    out = sanitize_key("a/" * 200)
    assert len(out) <= 250 and posixpath.normpath(out) == out and not out.endswith("/")


def test_run_params_metrics_events_artifacts(store, tmp_path):
    root, uri, cfg, sink = store
    assert isinstance(sink, MetricsSink)
    params = flatten(cfg)
    run_id = sink.start_run("train", params, tags={"policy": "tidal"})
    for step in range(1, 4):
        sink.log_metrics({"train/loss": 1.0 / step, "sched/idle_gpu_s": 0.5 * step, "bad key!": step,
                          "flag": True}, step=step)
    sink.log_event("reshard", {"step": 2, "bytes": 4096, "seconds": 0.25, "from": "tp1dp2", "to": "tp1dp4"})
    sink.log_event("reshard", {"bytes": 8192, "reshard/seconds": 0.5})  # no step: the last logged step (3)
    sink.log_event("scheduler", {"action": "grow_actor", "devices": [2, 3], "reason": "rollout drained",
                                 "device": 3, "time": 12.5, "version": 4})
    png = tmp_path / "timeline.png"
    png.write_bytes(b"\x89PNG fake")
    sink.log_artifact(png)
    sink.set_tag("phase", "done")
    sink.end_run("FINISHED")
    assert sink.run_id is None

    client = _client(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "train"
    assert run.data.tags["policy"] == "tidal" and run.data.tags["phase"] == "done"
    assert run.data.params["actor.lr"] == str(cfg.actor.lr)
    assert run.data.params["cluster.component_placement.actor"] == cfg.cluster.component_placement["actor"]
    assert run.data.params["actor.betas"] == "[0.9, 0.999]"
    assert len(run.data.params) == len(params)
    hist = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in hist) == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert [m.value for m in client.get_metric_history(run_id, "bad key_")] == [1.0, 2.0, 3.0]
    assert run.data.metrics["flag"] == 1.0
    rb = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reshard/bytes"))
    assert rb == [(2, 4096.0), (3, 8192.0)]
    assert [m.value for m in client.get_metric_history(run_id, "reshard/seconds")] == [0.25, 0.5]
    assert run.data.metrics["events/reshard"] == 2.0 and run.data.metrics["events/scheduler"] == 1.0
    assert "scheduler/action" not in run.data.metrics  # text and lists stay in events.json
    assert "scheduler/devices" not in run.data.metrics
    # ids, timestamps and versions are not measurements: events.json keeps them, the metrics do not
    assert not {"scheduler/device", "scheduler/time", "scheduler/version"} & set(run.data.metrics)

    arts = {a.path for a in client.list_artifacts(run_id)}
    assert arts == {"events.json", "timeline.png"}
    # Artifacts landed under the configured location, not the cwd.
    local = Path(client.download_artifacts(run_id, "events.json", str(tmp_path)))
    events = json.loads(local.read_text())
    assert [e["kind"] for e in events] == ["reshard", "reshard", "scheduler"]
    assert events[0]["step"] == 2 and events[0]["record"]["from"] == "tp1dp2"
    assert events[1]["step"] is None
    assert events[2]["record"]["devices"] == [2, 3]
    assert (root / "artifacts").is_dir()
    assert run.info.artifact_uri.startswith((root / "artifacts").resolve().as_uri())


def test_nested_runs_and_compare(store):
    _, uri, cfg, sink = store
    parent = sink.start_run("sweep", {"sweep.trials": 2})
    children = []
    for i, lr in enumerate((1e-4, 3e-4)):
        params = flatten(build_config({}, [f"actor.lr={lr}"]))
        child = sink.start_run(f"trial-{i}", params, parent_run_id=parent)
        assert sink.run_id == child
        sink.log_metrics({"eval/accuracy": 0.1 * (i + 1)}, step=0)
        sink.log_metrics({"eval/accuracy": 0.2 * (i + 1)}, step=1)
        sink.end_run()
        children.append(child)
    assert sink.run_id == parent
    sink.log_metrics({"sweep/best_accuracy": 0.4}, step=1)
    sink.end_run()

    client = _client(uri)
    for c in children:
        assert client.get_run(c).data.tags["mlflow.parentRunId"] == parent
    assert client.get_run(parent).data.metrics == {"sweep/best_accuracy": 0.4}
    assert "mlflow.parentRunId" not in client.get_run(parent).data.tags

    rows = compare_runs(children, uri)
    by_key = {(r.section, r.key): r.values for r in rows}
    assert by_key[("run", "name")] == ("trial-0", "trial-1")
    assert by_key[("run", "status")] == ("FINISHED", "FINISHED")
    assert by_key[("run", "parent")] == (parent, parent)
    params = {k for s, k in by_key if s == "param"}
    assert params == {"actor.lr"}  # only what differs
    assert by_key[("param", "actor.lr")] == ("0.0001", "0.0003")
    assert by_key[("metric", "eval/accuracy")] == pytest.approx((0.2, 0.4))  # final values
    stats = next(r.stats for r in rows if r.key == "eval/accuracy")   # and over the steps: mean, min, max
    assert stats[0] == pytest.approx((0.15, 0.1, 0.2)) and stats[1] == pytest.approx((0.3, 0.2, 0.4))
    assert all(isinstance(r, CompareRow) for r in rows)
    all_rows = compare_runs(children, uri, all_params=True)
    assert len([r for r in all_rows if r.section == "param"]) == len(flatten(cfg))


def test_compare_cli_and_errors(store):
    _, uri, _, sink = store
    a = sink.start_run("cli-a", {"x": 1})
    sink.log_metrics({"m/v": 2.5}, step=0)
    sink.end_run()
    b = sink.start_run("cli-b", {"x": 2})
    sink.end_run("FAILED")
    out = subprocess.run([sys.executable, "-m", "tidal.cli.main", "compare", a, b, "--uri", uri],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cli-a" in out.stdout and "FAILED" in out.stdout and "m/v" in out.stdout and "2.5" in out.stdout
    with pytest.raises(TidalError, match="no such run"):
        compare_runs([a, "0" * 32], uri)
    with pytest.raises(TidalError, match="no MLflow store"):
        compare_runs([a], "sqlite:////nonexistent/dir/mlruns.db")


def test_tracked_run_marks_failure_and_bad_metric(store):
    _, uri, _, sink = store
    with pytest.raises(ZeroDivisionError), tracked_run(sink, "boom", {}) as rid:
        sink.log_event("migration", {"step": 0, "requests": 3})
        raise ZeroDivisionError("boom")
    run = _client(uri).get_run(rid)
    assert run.info.status == "FAILED"
    assert {a.path for a in _client(uri).list_artifacts(rid)} == {"events.json"}  # flushed on failure too
    with tracked_run(sink, "typed", {}), pytest.raises(TypeError, match="non-numeric"):
        sink.log_metrics({"train/policy": "grpo"}, step=0)
    with pytest.raises(ValueError, match="run status"):
        sink.start_run("x", {})
        sink.end_run("DONE")
    sink.end_run()


def test_periodic_flush(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    sink = MlflowSink(uri, "flush", str(tmp_path / "art"), flush_every_s=0.0)
    rid = sink.start_run("live", {})
    sink.log_event("reshard", {"step": 0, "bytes": 1})
    # Written while the run is still open: a crashed driver leaves its events behind.
    local = Path(_client(uri).download_artifacts(rid, "events.json", str(tmp_path)))
    assert len(json.loads(local.read_text())) == 1
    sink.close()
    assert _client(uri).get_run(rid).info.status == "KILLED"


def test_null_sink_keeps_values():
    sink = NullSink()
    assert isinstance(sink, MetricsSink)
    p = sink.start_run("r", {"a.b": 1})
    sink.log_metrics({"reshard/bytes": 10}, step=1)
    sink.log_event("reshard", {"bytes": 20, "rate": float("nan"), "at": {"x": float("inf")}})
    c = sink.start_run("c", {}, parent_run_id=p)
    sink.end_run()
    sink.end_run("KILLED")
    assert sink.runs[p]["metrics"][:3] == [("reshard/bytes", 10.0, 1), ("events/reshard", 1.0, 1),
                                           ("reshard/bytes", 20.0, 1)]
    assert sink.runs[p]["metrics"][3][0] == "reshard/rate"  # NaN is still a metric value
    assert sink.runs[p]["status"] == "KILLED" and sink.runs[c]["parent"] == p
    assert sink.runs[p]["events"][0].record == {"bytes": 20, "rate": None, "at": {"x": None}}  # strict JSON


def test_library_import_does_not_pull_mlflow():
    code = "import sys, tidal.tracking; s = tidal.tracking.NullSink(); assert 'mlflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_mlflow_run_names_carry_the_policy_and_the_runs_time():
    """Two runs of one config under two policies (or twice) are told apart in MLflow's run list."""
    from pathlib import Path

    from tidal.core.config import build_config
    from tidal.pipeline.tracked_run import mlflow_run_name
    cfg = build_config({"run": {"name": "rlinf-dynamic"}}, [])
    folder = Path("runs/rlinf-dynamic-20261203-090102")
    assert mlflow_run_name(cfg, folder, "tidal") == "rlinf-dynamic-tidal-20261203-090102"
    assert mlflow_run_name(cfg, folder, "rlinf") == "rlinf-dynamic-rlinf-20261203-090102"
    assert mlflow_run_name(cfg, Path("elsewhere"), "static") == "rlinf-dynamic-static-elsewhere"
