"""MlflowSink against a real MLflow SQLite store (no server), read back with MlflowClient; NullSink; compare."""

from __future__ import annotations

import json
import posixpath
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.cli.compare import CompareRow, compare_groups, compare_runs, select_runs
from tidal.core.config import build_config, flatten
from tidal.core.errors import TidalError
from tidal.tracking import (
    EVENT_COLUMNS,
    EVENTS_TABLE,
    MetricsSink,
    MlflowSink,
    NullSink,
    run_url,
    sanitize_key,
    tracked_run,
)


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


def _table(client, run_id, tmp_path):
    return json.loads(Path(client.download_artifacts(run_id, EVENTS_TABLE, str(tmp_path))).read_text())


def test_run_params_metrics_events_artifacts(store, tmp_path, monkeypatch):
    root, uri, cfg, sink = store
    assert isinstance(sink, MetricsSink)
    params = flatten(cfg)
    run_id = sink.start_run("train", params, tags={"tidal.policy": "tidal"})
    for step in range(1, 4):
        sink.log_metrics({"train/loss": 1.0 / step, "sched/idle_gpu_s": 0.5 * step, "bad key!": step,
                          "flag": True}, step=step)
    # a placement change between steps: on MLflow's wall-time axis at its own time
    sink.log_metrics({"devices/actor": 6}, step=2, timestamp=1764412345.25)
    sink.log_event("reshard", {"step": 2, "iter": 1, "time": 7.5, "bytes": 4096, "seconds": 0.25,
                               "from": "tp=1,dp=2", "to": "tp=1,dp=4", "devices": [0, 1, 2, 3],
                               "component": "actor", "phases_s": {"transfer": 0.1}})
    sink.log_event("reshard", {"bytes": 8192, "seconds": 0.5})  # no step, no time
    sink.log_event("action", {"step": 3, "what": "ReleaseInference", "devices": [6, 7], "reason": "rollout drained",
                              "ok": False, "version": 4, "rate": float("nan")})
    png = tmp_path / "timeline.png"
    png.write_bytes(b"\x89PNG fake")
    sink.log_artifact(png)
    sink.set_tag("phase", "done")
    sink.end_run("FINISHED")
    assert sink.run_id is None

    client = _client(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "train"
    assert run.data.tags["tidal.policy"] == "tidal" and run.data.tags["phase"] == "done"
    assert run.data.params["actor.lr"] == str(cfg.actor.lr)
    assert run.data.params["cluster.component_placement.actor"] == cfg.cluster.component_placement["actor"]
    assert run.data.params["actor.betas"] == "[0.9, 0.999]"
    assert len(run.data.params) == len(params)
    hist = client.get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in hist) == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert [m.value for m in client.get_metric_history(run_id, "bad key_")] == [1.0, 2.0, 3.0]
    assert run.data.metrics["flag"] == 1.0
    [dev] = client.get_metric_history(run_id, "devices/actor")
    assert (dev.value, dev.step, dev.timestamp) == (6.0, 2, 1764412345250)
    # events write no metrics: a per-event metric would put several values on one step
    assert set(run.data.metrics) == {"train/loss", "sched/idle_gpu_s", "bad key_", "flag", "devices/actor"}

    assert {a.path for a in client.list_artifacts(run_id)} == {EVENTS_TABLE, "timeline.png"}
    table = _table(client, run_id, tmp_path)
    assert table["columns"] == list(EVENT_COLUMNS)
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [r["kind"] for r in rows] == ["reshard", "reshard", "action"]
    first = rows[0]
    assert (first["t_s"], first["step"], first["iter"], first["component"], first["devices"], first["from"],
            first["to"], first["seconds"], first["bytes"]) == (7.5, 2, 1, "actor", "0,1,2,3", "tp=1,dp=2",
                                                               "tp=1,dp=4", 0.25, 4096.0)
    assert json.loads(first["detail"]) == {"phases_s": {"transfer": 0.1}}   # what has no column of its own
    assert rows[1]["step"] is None and rows[1]["iter"] is None and 0 <= rows[1]["t_s"] < 600  # since run start
    last = rows[2]
    assert (last["what"], last["devices"], last["ok"], last["reason"]) == ("ReleaseInference", "6,7", False,
                                                                          "rollout drained")
    assert json.loads(last["detail"]) == {"version": 4, "rate": None}   # strict JSON: NaN -> null
    # an MLflow table: listed by the run's tag, read back by MLflow's own reader, runs side by side
    assert {"path": EVENTS_TABLE, "type": "table"} in json.loads(run.data.tags["mlflow.loggedArtifacts"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)   # load_table searches runs through mlflow's global URI
    df = client.load_table(sink.experiment_id, EVENTS_TABLE, run_ids=[run_id], extra_columns=["run_id"])
    assert list(df["kind"]) == ["reshard", "reshard", "action"] and set(df["run_id"]) == {run_id}
    assert (root / "artifacts").is_dir()
    assert run.info.artifact_uri.startswith((root / "artifacts").resolve().as_uri())


def test_nested_runs_and_compare(store):
    _, uri, cfg, sink = store
    parent = sink.start_run("sweep", {"sweep.trials": 2})
    children = []
    for i, lr in enumerate((1e-4, 3e-4)):
        params = flatten(build_config({}, [f"actor.lr={lr}"]))
        child = sink.start_run(f"trial-{i}", params, {"tidal.sweep": "lr", "tidal.trial": str(i)},
                               parent_run_id=parent)
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
    assert by_key[("run", "sweep")] == ("lr", "lr") and by_key[("run", "trial")] == ("0", "1")
    assert ("run", "policy") not in by_key   # no run has the tag
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
    assert {a.path for a in _client(uri).list_artifacts(rid)} == {EVENTS_TABLE}  # flushed on failure too
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
    assert len(_table(_client(uri), rid, tmp_path)["data"]) == 1
    sink.close()
    assert _client(uri).get_run(rid).info.status == "KILLED"


def test_null_sink_keeps_values():
    sink = NullSink()
    assert isinstance(sink, MetricsSink)
    p = sink.start_run("r", {"a.b": 1})
    sink.log_metrics({"reshard/total_bytes": 10}, step=1)
    sink.log_metrics({"devices/actor": 4}, step=1, timestamp=12.5)
    sink.log_event("reshard", {"bytes": 20, "rate": float("nan"), "at": {"x": float("inf")}})
    assert [r[3] for r in sink.table()["data"]] == ["reshard"]
    c = sink.start_run("c", {}, parent_run_id=p)
    sink.end_run()
    sink.end_run("KILLED")
    assert sink.runs[p]["metrics"] == [("reshard/total_bytes", 10.0, 1), ("devices/actor", 4.0, 1, 12.5)]
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


def test_compare_groups_runs_by_policy_and_by_sweep(tmp_path):
    """Runs of two policies and two sweeps' trials, chosen by experiment or by sweep and grouped by their tags:
    per group the number of runs, the params that differ, each metric's final value averaged over the runs and
    its mean, min and max over every step of every run."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    sink = MlflowSink(uri, "policies", str(tmp_path / "art"))
    ids = {}
    for name, policy, sweep, times in (("a", "rlinf", "s1", [4.0, 2.0]), ("b", "rlinf", "s1", [6.0, 4.0]),
                                       ("c", "tidal", "s2", [3.0, 1.0]), ("d", "static", None, [5.0])):
        tags = {"tidal.policy": policy, **({"tidal.sweep": sweep, "tidal.trial": name} if sweep else {})}
        ids[name] = sink.start_run(name, {"scheduler.policy": policy, "seed": name}, tags)
        for step, t in enumerate(times):
            sink.log_metrics({"step/time_s": t}, step)
        sink.end_run()
    assert select_runs(uri, experiment="policies") == [ids[n] for n in "abcd"]
    assert select_runs(uri, sweep="s1") == [ids["a"], ids["b"]]
    assert select_runs(uri, ["x"]) == ["x"]

    names, rows = compare_groups(select_runs(uri, experiment="policies"), uri, "policy")
    assert names == ["rlinf", "static", "tidal"]
    by_key = {(r.section, r.key): r for r in rows}
    assert by_key[("run", "runs")].values == (2, 1, 1)
    assert by_key[("param", "scheduler.policy")].values == ("rlinf", "static", "tidal")
    assert by_key[("param", "seed")].values == ("<2 values>", "d", "c")
    t = by_key[("metric", "step/time_s")]
    assert t.values == pytest.approx((3.0, 5.0, 1.0))        # final values, averaged over the group's runs
    assert t.stats[0] == pytest.approx((4.0, 2.0, 6.0))      # every step of both rlinf runs
    assert t.stats[1] is None and t.stats[2] == pytest.approx((2.0, 1.0, 3.0))
    names, rows = compare_groups(list(ids.values()), uri, "sweep")
    assert names == ["s1", "s2", "(none)"]
    assert rows[0].values == (2, 1, 1)

    out = subprocess.run([sys.executable, "-m", "tidal.cli.main", "compare", "--experiment", "policies",
                          "--group-by", "policy", "--uri", uri], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rlinf" in out.stdout and "static" in out.stdout and "step/time_s" in out.stdout
    with pytest.raises(TidalError, match="--group-by"):
        compare_groups(list(ids.values()), uri, "color")
    with pytest.raises(TidalError, match="--experiment.*no such experiment"):
        select_runs(uri, experiment="nope")
    with pytest.raises(TidalError, match="--sweep.*matches no run"):
        select_runs(uri, sweep="nope")
    with pytest.raises(TidalError, match="no runs chosen"):
        select_runs(uri)


def test_run_url_names_a_servers_run_page_only():
    assert run_url("http://127.0.0.1:5000/", "3", "abc") == (
        "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning")   # the model-training view
    assert run_url("sqlite:///mlruns.db", "3", "abc") is None
