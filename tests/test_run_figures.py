"""Numbers that agree wherever a run shows them.

- The idle fraction, one definition per window: `run/idle_fraction` (the whole run) is the summary's
  `device_idle_fraction`, the MLflow metric and timeline.png's title; `step/idle_fraction` is each step's window,
  `run/step_idle_fraction` all of them (a real short run).
- The run's totals (`run/...`) are logged once and are summary.json's `figures`, the same floats.
- A migration wave's seconds stand once in the events table, and its column sums to `migration/total_s`.
- A stop from outside (Ctrl-C, SIGTERM, a Prefect cancel) ends the MLflow run KILLED and the database row
  `aborted`; any other error FAILED / `failed`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.pipeline.run_metrics import step_event_metrics, table_fields
from tidal.pipeline.timeline import Timeline, timeline_title
from tidal.pipeline.tracked_run import closing_status
from tidal.tracking import NullSink, wave_heads

REPO = Path(__file__).resolve().parents[1]
#: a small run on 3 CPU virtual devices, one per component, the tidal policy deciding
SMALL = {
    "run": {"num_steps": 2, "seed": 3, "name": "figures"},
    "cluster": {"num_devices_per_node": 3, "component_placement": {"actor": 0, "rollout": 1, "inference": 2},
                "auto_scheduler": True},
    "scheduler": {"policy": "tidal"},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 16, "max_running_requests": 16},
    "algorithm": {"group_size": 4, "n_minibatches": 2},
    "data": {"rollout_batch_size": 8, "eval_size": 8},
    "warm_start": {"iters": 0},
}


def _migration(src: int, dst: int, seconds: float, wave: int, step: int = 1, first: bool = True) -> dict:
    return {"kind": "migration", "time": 8.0, "step": step, "src": src, "dst": dst, "groups": 1, "requests": 2,
            "kv_bytes": 10, "mode": "kv", "seconds": seconds, "wave": wave, "wave_first": first}


# --- a migration wave: one duration -----------------------------------------------------------------------------

WAVES = [
    _migration(2, 4, 0.4, wave=3), _migration(3, 4, 0.4, wave=3, first=False),
    _migration(5, 4, 0.4, wave=3, first=False),                                                       # one wave
    {"kind": "action", "time": 8.5, "step": 1, "action": "MigrateBatch", "seconds": 0.01},
    _migration(2, 3, 0.2, wave=1),                                                         # a wave of one move
    _migration(4, 2, 0.3, wave=2), _migration(5, 2, 0.3, wave=2, first=False),   # two waves of two moves with
    _migration(4, 3, 0.3, wave=2), _migration(5, 3, 0.3, wave=2, first=False),   # the same seconds: two durations
    _migration(4, 3, 0.3, wave=2, step=2),                                       # a new step: a new wave
]


def test_wave_heads_mark_the_first_move_of_each_wave():
    assert wave_heads([(ev["kind"], ev) for ev in WAVES]) == [
        True, False, False, True, True, True, False, True, False, True]


def test_a_waves_seconds_stand_once_in_the_events_table_and_sum_to_the_steps_total():
    sink = NullSink()
    sink.start_run("waves", {})
    for ev in WAVES:
        sink.log_event(ev["kind"], table_fields(ev))
    table = sink.table()
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    migrations = [r for r in rows if r["kind"] == "migration"]
    assert [r["seconds"] for r in migrations] == [0.4, None, None, 0.2, 0.3, None, 0.3, None, 0.3]
    assert all(json.loads(r["detail"])["wave"] >= 1 for r in migrations)   # the moves that share the seconds
    step1 = [r for r in migrations if r["step"] == 1]
    totals = step_event_metrics([ev for ev in WAVES if ev["step"] == 1])
    assert totals["migration/count"] == len(step1) == 8
    assert totals["migration/total_s"] == pytest.approx(sum(r["seconds"] or 0.0 for r in step1)) \
        == pytest.approx(0.4 + 0.2 + 0.3 + 0.3)


# --- the idle fraction's windows --------------------------------------------------------------------------------


def test_each_idle_fraction_names_its_window():
    tl = Timeline()
    tl.add_owned([0, 1], "actor", 0.0, 10.0)
    tl.add_busy([0, 1], "actor", "iter", 2.0, 4.0)     # step 0: [2, 4], both devices busy throughout
    tl.add_busy([0], "actor", "iter", 6.0, 8.0)         # step 1: [6, 8], one device of two busy
    tl.add_step_window(0, 2.0, 4.0)
    tl.add_step_window(1, 6.0, 8.0)
    assert tl.idle_fraction(2.0, 4.0) == 0.0 and tl.idle_fraction(6.0, 8.0) == 0.5   # step/idle_fraction
    assert tl.steps_idle_fraction() == pytest.approx(1 - 6 / 8)                      # run/step_idle_fraction
    assert tl.idle_fraction() == pytest.approx(1 - 6 / 20)                           # run/idle_fraction
    assert tl.to_json()["step_windows"] == [{"step": 0, "t0": 2.0, "t1": 4.0}, {"step": 1, "t0": 6.0, "t1": 8.0}]
    assert Timeline().idle_fraction() == Timeline().steps_idle_fraction() == 0.0      # nothing owned, none idle
    title = tl.figure().axes[0].get_title()
    assert title == timeline_title("device timeline", tl.idle_fraction()) == "device timeline (run/idle_fraction 0.70)"


@pytest.mark.usefixtures("shared_ray")
def test_a_real_run_shows_one_idle_fraction_and_one_set_of_totals_everywhere(tmp_path, monkeypatch):
    from tidal.core.config import build_config, flatten
    from tidal.pipeline.run import TrainingRun

    titles: list[str] = []
    draw = Timeline.draw
    monkeypatch.setattr(Timeline, "draw", lambda self, path, title="", origin=None: (
        titles.append(title), draw(self, path, title, origin))[1])
    cfg = build_config(SMALL, [f"run.output_dir={tmp_path}"])
    sink = NullSink()
    run_id = sink.start_run("figures", flatten(cfg))
    run = TrainingRun(cfg, tmp_path / "figures", sink)
    try:
        run.open()
        for _ in range(cfg.run.num_steps):
            run.step()
        summary = run.finish()
    finally:
        run.close()

    logged = sink.runs[run_id]["metrics"]
    totals = {name: (value, step) for name, value, step, *_ in logged if name.startswith("run/")}
    on_disk = json.loads((tmp_path / "figures" / "summary.json").read_text())
    assert on_disk["figures"] == summary.figures == {name: value for name, (value, _) in totals.items()}
    assert {step for _, step in totals.values()} == {cfg.run.num_steps - 1}   # once, at the last step
    assert sum(name.startswith("run/") for name, *_ in logged) == len(totals) == 10

    idle = summary.figures["run/idle_fraction"]
    assert on_disk["device_idle_fraction"] == summary.device_idle_fraction == idle
    assert titles == [timeline_title(f"figures: {summary.policy} policy", idle)] and f"{idle:.2f}" in titles[0]
    assert on_disk["wall_s"] == summary.figures["run/wall_s"]
    assert summary.figures["run/mean_step_s"] == pytest.approx(sum(summary.step_seconds) / cfg.run.num_steps)
    assert summary.figures["run/steps"] == cfg.run.num_steps
    assert (summary.figures["run/reshards"], summary.figures["run/migrations"]) == (summary.reshards,
                                                                                    summary.migrations)
    assert summary.figures["run/heldout_accuracy_end"] == summary.eval_accuracy_end
    assert summary.figures["run/reward_mean_last"] == summary.reward_per_step[-1]

    # each step's figure is the timeline's over that step's window; the steps' figure is over all of them
    timeline = json.loads((tmp_path / "figures" / "timeline.json").read_text())
    windows = [(w["t0"], w["t1"]) for w in timeline["step_windows"]]
    assert len(windows) == cfg.run.num_steps
    per_step = [value for name, value, *_ in logged if name == "step/idle_fraction"]
    tl = run._pipe.timeline
    assert per_step == pytest.approx([tl.idle_fraction(t0, t1) for t0, t1 in windows], abs=0.01)
    assert summary.figures["run/step_idle_fraction"] == tl.windows_idle_fraction(windows)
    assert 0.0 <= summary.figures["run/step_idle_fraction"] <= 1.0 and 0.0 <= idle <= 1.0

    documented = (REPO / "docs" / "platform.md").read_text()
    assert [name for name in totals if f"`{name}`" not in documented] == [], "add them to docs/platform.md"


# --- how a run ends ---------------------------------------------------------------------------------------------


def _prefect_stops() -> list[BaseException]:
    import signal

    from prefect.exceptions import Abort, CancelledRun, TerminationSignal
    return [TerminationSignal(signal.SIGTERM), Abort("the flow run was cancelled"), CancelledRun("cancelled")]


def test_a_stop_from_outside_is_killed_any_other_error_failed():
    from tidal.cli.main import Terminated
    from tidal.workers.errors import WorkerDied

    stops = [KeyboardInterrupt(), Terminated(), asyncio.CancelledError(), *_prefect_stops()]
    assert [closing_status(e) for e in stops] == ["KILLED"] * len(stops)
    try:   # asyncio.wait_for's timeout, raised from the CancelledError of the call it cut short: a failure
        raise TimeoutError() from asyncio.CancelledError()
    except TimeoutError as timeout:
        timed_out = timeout
    errors = [RuntimeError("boom"), WorkerDied(3, "gone"), timed_out, SystemExit(1)]
    assert [closing_status(e) for e in errors] == ["FAILED"] * len(errors)


def test_what_a_prefect_cancel_raises_in_the_flows_code_ends_it_killed():
    """A cancelled flow run's process gets SIGTERM from its runner; Prefect's handler (installed while a flow runs,
    `capture_sigterm`) raises it in the flow's code. In a child process: the signal is real."""
    code = (
        "import os, signal, time\n"
        "from prefect.utilities.engine import capture_sigterm\n"
        "from tidal.pipeline.tracked_run import closing_status\n"
        "with capture_sigterm():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(30)\n"
        "    except BaseException as exc:\n"
        "        print(type(exc).__module__, type(exc).__name__, closing_status(exc))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["prefect.exceptions", "TerminationSignal", "KILLED"], out.stderr


@pytest.mark.parametrize("stop,mlflow_status,db_status", [
    (KeyboardInterrupt(), "KILLED", "aborted"),
    ("prefect cancel", "KILLED", "aborted"),
    (RuntimeError("boom"), "FAILED", "failed"),
])
def test_close_writes_the_same_ending_to_mlflow_and_the_database(tmp_path, stop, mlflow_status, db_status):
    from mlflow.tracking import MlflowClient

    from db import repository as repo
    from db.session import make_engine, session_scope
    from tidal.core.config import build_config
    from tidal.pipeline.tracked_run import RunTracking

    exc = _prefect_stops()[0] if stop == "prefect cancel" else stop
    uri, db_url = f"sqlite:///{tmp_path / 'mlruns.db'}", f"sqlite:///{tmp_path / 'tidal.db'}"
    cfg = build_config({"run": {"name": "ending"}, "tracking": {"mlflow_uri": uri, "db_url": db_url,
                                                                "mlflow_artifacts": str(tmp_path / "art")}})
    tracking = RunTracking.open(cfg, tmp_path / "ending")
    tracking.close(closing_status(exc))
    assert MlflowClient(tracking_uri=uri).get_run(tracking.mlflow_run_id).info.status == mlflow_status
    engine = make_engine(db_url)
    try:
        with session_scope(engine) as s:
            assert repo.get_run(s, tracking.db_run_id).status == db_status
    finally:
        engine.dispose()


def test_every_mlflow_ending_has_its_database_status():
    from db import repository as repo
    from db.checks import InvalidRecord

    assert {m: repo.status_of_mlflow(m) for m in ("FINISHED", "FAILED", "KILLED")} == {
        "FINISHED": "finished", "FAILED": "failed", "KILLED": "aborted"}
    with pytest.raises(InvalidRecord, match="FINISHED, FAILED or KILLED"):
        repo.status_of_mlflow("CANCELLED")
