"""A run whose driver dies without a word (SIGKILL) is found and marked `lost` by the next command that starts a
run: its driver's heartbeat (`runs.heartbeat_at`) stopped."""

import datetime as dt
import signal
import subprocess
import sys
import time

import pytest

from db import add_run, get_run, heartbeat, list_runs, mark_lost, open_database, session_scope
from db.migrate import downgrade, schema_diff, upgrade

DRIVER = """
import sys, time
from tidal.core.config import build_config
from tidal.pipeline.tracked_run import RunTracking
cfg = build_config({}, [f"tracking.db_url={sys.argv[1]}", f"tracking.mlflow_uri={sys.argv[2]}",
                        f"tracking.mlflow_artifacts={sys.argv[3]}", "run.name=doomed"])
tracking = RunTracking.open(cfg, sys.argv[4])
print("open", tracking.db_run_id, flush=True)
time.sleep(600)
"""


def _urls(tmp_path):
    return (f"sqlite:///{tmp_path}/tidal.db", f"sqlite:///{tmp_path}/mlruns.db", str(tmp_path / "artifacts"))


def test_a_killed_driver_is_marked_lost_by_the_next_run_in_the_database_and_mlflow(tmp_path, monkeypatch):
    from tidal.core.config import build_config
    from tidal.pipeline import tracked_run
    db_url, ml_uri, artifacts = _urls(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, db_url, ml_uri, artifacts, str(tmp_path / "out")],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("open"), line
        engine = open_database(db_url)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:   # the first beat lands right after the row
            with session_scope(engine) as s:
                (run,) = list_runs(s)
                if run.heartbeat_at is not None:
                    break
            time.sleep(0.1)
        assert run.status == "running" and run.heartbeat_at is not None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    time.sleep(1.5)
    monkeypatch.setattr(tracked_run, "LOST_AFTER_S", 1.0)   # time compressed: the silence has lasted long enough
    cfg = build_config({}, [f"tracking.db_url={db_url}", f"tracking.mlflow_uri={ml_uri}",
                            f"tracking.mlflow_artifacts={artifacts}", "run.name=next"])
    nxt = tracked_run.RunTracking.open(cfg, tmp_path / "next")
    try:
        with session_scope(engine) as s:
            runs = {r.name: r for r in list_runs(s)}
            assert runs["doomed"].status == "lost" and runs["doomed"].ended_at == runs["doomed"].heartbeat_at
            assert runs["next"].status == "running"
            doomed_mlflow = runs["doomed"].mlflow_run_id
        assert nxt.sink.client.get_run(doomed_mlflow).info.status == "KILLED"   # the same story in MLflow
    finally:
        nxt.close("FINISHED")
    with session_scope(engine) as s:
        assert {r.name: r.status for r in list_runs(s)} == {"doomed": "lost", "next": "finished"}


def test_mark_lost_spares_runs_with_a_recent_heartbeat(tmp_path):
    engine = open_database(f"sqlite:///{tmp_path}/tidal.db")
    now = dt.datetime.now(dt.UTC)
    with session_scope(engine) as s:
        alive, silent, never = (add_run(s, name=n, config={}).id for n in ("alive", "silent", "never"))
        heartbeat(s, alive, at=now - dt.timedelta(seconds=5))
        heartbeat(s, silent, at=now - dt.timedelta(seconds=500))
        get_run(s, never).started_at = now - dt.timedelta(seconds=900)   # started long ago, never beat
    with session_scope(engine) as s:
        lost = sorted(r.name for r in mark_lost(s, stale_after_s=120, now=now))
    assert lost == ["never", "silent"]
    with session_scope(engine) as s:
        assert {r.name: r.status for r in list_runs(s)} == {"alive": "running", "silent": "lost", "never": "lost"}


@pytest.mark.parametrize("direction", ["up", "down-up"])
def test_the_heartbeat_revision_migrates_both_ways(tmp_path, direction):
    url = f"sqlite:///{tmp_path}/tidal.db"
    upgrade(url, "0001")
    engine = open_database(url)   # to head: 0002
    with session_scope(engine) as s:
        add_run(s, name="before", config={})
    if direction == "down-up":
        downgrade(url, "0001")
        upgrade(url)
    assert schema_diff(engine) == []
    with session_scope(engine) as s:
        assert [r.name for r in list_runs(s)] == ["before"]
