"""The platform as a flow run shows it: the database row links the flow run and the MLflow run (whose description
links back); the flow run's log holds a line per stage of the opening (its open-run task), a line per RL step
(`step 0 of 2` first: the step index MLflow and the subflows use) and the run's warnings; its artifacts the run's
progress and its MLflow run from the moment that run exists, and at the end its summary.

Flows run in this process on a temporary local Prefect server (Prefect's own test harness: a real server and
database, nothing mocked); what the flow wrote is read back through the Prefect API, MLflow's client and the
platform database.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from pathlib import Path

import pytest
from training_equality import PARITY_REWARD, assert_same_training, start_weights, trained, trained_from_folder

REPO = Path(__file__).resolve().parents[1]


def _tracking(tmp_path: Path) -> list[str]:
    return [f"tracking.db_url=sqlite:///{tmp_path}/tidal.db", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlruns.db",
            f"tracking.mlflow_artifacts={tmp_path}/mlartifacts", f"run.output_dir={tmp_path}/runs",
            "run.name=linked"]


def test_the_run_row_holds_the_flow_run_and_the_mlflow_run(local_prefect, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from prefect import flow
    from prefect.runtime import flow_run

    from db import list_runs, open_database, session_scope
    from tasks.training import open_tracking
    from tidal.pipeline.tracked_run import load_run_config, run_dir
    for var in ("TIDAL_DB_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_run_config(REPO / "experiments/addition_dynamic.yaml", _tracking(tmp_path))

    @flow(name="open-tracking")
    def opened() -> tuple[str, int | None, str | None]:
        tracking = open_tracking(cfg, run_dir(cfg))   # what rl-training's open_run does first
        tracking.close("FINISHED")
        return str(flow_run.id), tracking.db_run_id, tracking.mlflow_run_id

    flow_run_id, db_run_id, mlflow_run_id = opened()
    engine = open_database(cfg.tracking.db_url)
    with session_scope(engine) as s:
        (row,) = list_runs(s, prefect_flow_run_id=flow_run_id)
        assert (row.id, row.mlflow_run_id, row.status) == (db_run_id, mlflow_run_id, "finished")
    engine.dispose()
    client = MlflowClient(tracking_uri=cfg.tracking.mlflow_uri)
    tags = client.get_run(mlflow_run_id).data.tags
    assert tags["prefect.flow_run_id"] == flow_run_id and tags["tidal.db_run_id"] == str(db_run_id)
    assert flow_run_id in tags["mlflow.note.content"]   # the description: the way back to the flow run
    exp = client.get_experiment(client.get_run(mlflow_run_id).info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"   # MLflow opens it for model training


#: a step's line in the flow run's log (`tasks.reporting.step_line`), not a warning that names a step
STEP_LINE = re.compile(r"step \d+ of \d+  reward ")
#: 2 rlinf steps on 4 CPU virtual devices, seconds each; the actor reshards (how often follows the timing)
TINY = REPO / "experiments/tiny_dynamic.yaml"


def _read(flow_run_id: str, timed: bool = False):
    """The flow run's log lines (its own and its tasks', not its subflows') and its artifacts, through the Prefect
    API; `timed`: each line as (timestamp, message)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    async def read():
        async with get_client() as client:
            ids = [uuid.UUID(flow_run_id)]
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))
            arts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
            lines = [(lg.timestamp, lg.message) if timed else lg.message for lg in logs]
            return lines, {a.key: a for a in arts}
    return asyncio.run(read())


def test_a_flow_run_shows_each_step_its_progress_and_the_summary(local_prefect, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from db import list_runs, open_database, session_scope
    from flows.rl_training import rl_training
    from tasks.requests import TrainingRequest
    for var in ("TIDAL_DB_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    overrides = [*_tracking(tmp_path)[:-1], "run.name=tiny_flow"]   # a name Prefect's keys cannot take as it is
    state = rl_training(TrainingRequest(config=str(TINY), overrides=overrides), return_state=True)
    summary = state.result()
    flow_run_id = str(state.state_details.flow_run_id)

    deadline = time.monotonic() + 60   # logs reach the server in batches, a moment after the flow ends
    lines, arts = _read(flow_run_id)
    while sum(bool(STEP_LINE.match(line)) for line in lines) < 2 and time.monotonic() < deadline:
        time.sleep(1)
        lines, arts = _read(flow_run_id)
    steps = [line for line in lines if STEP_LINE.match(line)]
    assert [line.split("  ")[0] for line in steps] == ["step 0 of 2", "step 1 of 2"], lines
    # the opening, a line per stage, in order, before the first step
    stages = ("opening the run", "config checked", "tracking: database row", "tracking ready",
              "model loaded", "workers started", "weights placed", "first evaluation", "run open after")
    found = [next((i for i, line in enumerate(lines) if stage in line), -1) for stage in stages]
    assert -1 not in found and found == sorted(found) and found[-1] < lines.index(steps[0]), (found, lines)
    for line in steps:   # reward, held-out (evaluated every step), time, phases, moves
        assert "reward " in line and "held-out " in line and "generate " in line and "sync " in line
    moves = [int(line.split("| ")[-1].split(" reshard")[0]) for line in steps]
    assert sum(moves) == summary["reshards"], (steps, summary["reshards"])

    assert set(arts) >= {"tiny-flow-progress", "tiny-flow-mlflow", "tiny-flow-summary"}, sorted(arts)
    timed, _ = _read(flow_run_id, timed=True)
    first_step_at = min(t for t, line in timed if STEP_LINE.match(line))
    for key in ("tiny-flow-progress", "tiny-flow-mlflow"):   # made as the run opened, not at its end
        assert arts[key].created < first_step_at, (key, arts[key].created, first_step_at)
    assert f"`{summary['mlflow_run_id']}`" in arts["tiny-flow-mlflow"].data
    assert arts["tiny-flow-progress"].type == "progress" and arts["tiny-flow-progress"].data == 100.0
    md = arts["tiny-flow-summary"]
    assert md.type == "markdown" and "| steps | 2 |" in md.data and f"| reshards | {summary['reshards']} |" in md.data
    assert f"`{summary['mlflow_run_id']}`" in md.data and "mlflow ui --backend-store-uri sqlite:///" in md.data

    engine = open_database(f"sqlite:///{tmp_path}/tidal.db")
    with session_scope(engine) as s:
        (row,) = list_runs(s, prefect_flow_run_id=flow_run_id)
        assert (row.id, row.mlflow_run_id, row.status) == (summary["db_run_id"], summary["mlflow_run_id"],
                                                           "finished")
    engine.dispose()
    history = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns.db").get_metric_history(
        summary["mlflow_run_id"], "reshard/count")
    assert sum(m.value for m in history) == summary["reshards"]


def test_a_steps_warning_lands_on_the_runs_own_log(local_prefect):
    """A warning a step raised (tidal.pipeline.run_warnings) is logged by `report_step` in the parent flow run,
    whose page the user watches, not in the step's subflow."""
    from types import SimpleNamespace

    from prefect import flow
    from prefect.runtime import flow_run

    from tasks import registry
    from tasks.training import OpenedRun, _Live, report_step
    from tidal.pipeline.run_loop import LoopSettings
    from tidal.pipeline.run_warnings import RunWarning
    pending = [RunWarning("zero_advantage", "step 0: every group has zero advantage")]
    fake = SimpleNamespace(drain_warnings=lambda: [pending.pop()] if pending else [])
    key = registry.put("run", _Live(fake, None))  # type: ignore[arg-type]

    @flow(name="warned")
    def warned() -> str:
        report_step(OpenedRun(key, "w", "rlinf", "", None, None, LoopSettings(2, 1, 0, False, 0)), 0,
                    {"step/time_s": 1.0})
        return str(flow_run.id)

    try:
        flow_run_id = warned()
    finally:
        registry.pop(key)
    deadline = time.monotonic() + 30
    lines, _ = _read(flow_run_id)
    while not any("zero advantage" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(1)
        lines, _ = _read(flow_run_id)
    steps = [line for line in lines if STEP_LINE.match(line)]
    assert len(steps) == 1 and steps[0].startswith("step 0 of 2  reward "), lines
    assert "step 0: every group has zero advantage" in lines, lines


def test_the_deployment_refuses_bad_typed_fields_when_the_run_is_asked_for(local_prefect):
    """The server checks a request against the flow's schema (`enforce_parameter_schema`): a bad value is refused
    at `create_flow_run`, naming the field, and no flow run exists."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    from flows.serve import deployments
    (dep,) = deployments(("rl-training",))
    dep_id = dep.apply()

    async def ask(request: dict) -> str:
        async with get_client() as client:
            try:
                run = await client.create_flow_run_from_deployment(dep_id, parameters={"request": request})
            except PrefectHTTPStatusError as err:
                return err.response.json()["detail"]
            await client.delete_flow_run(run.id)
            return "created"
    assert "request.num_steps" in asyncio.run(ask({"num_steps": 0}))
    assert "request.policy" in asyncio.run(ask({"policy": "rlinx"}))
    assert "request.seed" in asyncio.run(ask({"seed": -1}))
    assert asyncio.run(ask({"policy": "rlinf", "num_steps": 2, "overrides": ["actor.lr=1e-4"]})) == "created"


@pytest.mark.parametrize("request_fields, field", [
    ({"num_steps": 3, "overrides": ["run.num_steps=2"]}, "num_steps"),   # a field and an override disagree
    ({"config": "experiments/no-such-config.yaml"}, "config"),          # the config file is missing
    ({"policy": "rlinf", "auto_scheduler": False}, "policy"),           # a policy that would do nothing
])
def test_a_bad_request_fails_its_flow_run_before_any_run_exists(local_prefect, tmp_path, monkeypatch,
                                                                request_fields, field):
    from tidal.core.errors import ConfigError
    monkeypatch.chdir(REPO)
    from flows.rl_training import rl_training
    request = {"config": "experiments/addition_dynamic.yaml", **request_fields}
    request["overrides"] = [*request.get("overrides", []), *_tracking(tmp_path)]
    state = rl_training(request=request, return_state=True)   # as a served run gets it: JSON, validated here
    assert state.is_failed()
    with pytest.raises(ConfigError) as info:
        state.result()
    assert info.value.field == field and "Fix:" in str(info.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tidal.db").exists()


def test_a_flow_run_carries_on_when_the_actors_worker_is_killed(local_prefect, tmp_path, monkeypatch):
    """`actor.redundancy: host`: the actor's worker (device 0) is killed as step 2 starts; its subflow fails, the
    flow recovers in process (`recover-run`: the surviving workers go on from the host copy kept after step 1, the
    actor on a rollout device) and runs step 2 again; the flow run finishes, with one restart in its summary and
    the host copy's memory given back."""
    import signal
    import threading

    from flows.rl_training import rl_training
    from tasks import registry
    from tasks.requests import TrainingRequest
    for var in ("TIDAL_DB_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    killed: list[int] = []

    def kill_as_step_2_starts():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            for key in registry.live():
                try:
                    run = registry.get(key, "run").run
                except LookupError:
                    continue
                st = getattr(run.pipe, "step_state", None)
                if st is not None and st.step == 1:   # step 2 under way: the copy of step 1's end is kept
                    killed.append(run.group.pid(0))
                    os.kill(killed[0], signal.SIGKILL)
                    return
            time.sleep(0.02)
    killer = threading.Thread(target=kill_as_step_2_starts, daemon=True)
    killer.start()
    overrides = [*_tracking(tmp_path)[:-1], "run.name=kept", "actor.redundancy=host", "run.max_restarts=1",
                 "cluster.replace_failed=false"]
    state = rl_training(TrainingRequest(config=str(TINY), overrides=overrides), return_state=True)
    killer.join(timeout=1)
    summary = state.result()
    assert killed, "the actor's worker was never killed"
    (restart,) = summary["restarts"]
    assert restart["workers"] == "kept" and restart["device"] == 0 and restart["resumed_step"] == 1, restart
    assert restart["source"] == "host copy" and restart["layout_to"] == "tp=1,dp=1,devices=2", restart
    assert not Path(restart["resumed_from"]).parent.exists()   # close-run gave the copy's memory back


def _subflow_names(flow_run_id: str) -> list[str]:
    """The names of a flow run's subflow runs (its `rl-step` runs), oldest first, through the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    async def read():
        async with get_client() as client:
            runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[uuid.UUID(flow_run_id)])),
                sort=FlowRunSort.START_TIME_ASC)
            return [r.name for r in runs]
    return asyncio.run(read())


def test_a_flow_run_resumes_from_a_checkpoint_of_an_earlier_run(local_prefect, tmp_path, monkeypatch):
    """A 2-step run as `tidal train` runs it (`run_training`) keeps a checkpoint after each step; a flow run given
    the first one as `resume_from` opens at step 1 (the opening says so), runs that step alone (one subflow,
    `step-1`; one database row, step 1) and ends with the uninterrupted run's weights, bit for bit."""
    from db import list_runs, list_steps, open_database, session_scope
    from flows.rl_training import rl_training
    from tasks.requests import TrainingRequest
    from tidal.pipeline.run import TrainingRun
    from tidal.pipeline.tracked_run import load_run_config, run_dir
    for var in ("TIDAL_DB_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    settings = [f"run.output_dir={tmp_path}/runs", f"reward.function={PARITY_REWARD}"]   # every iter trains
    cfg = load_run_config(TINY, [*settings, "run.name=earlier"])
    run = TrainingRun(cfg, run_dir(cfg))   # the uninterrupted run, a checkpoint after its first step
    try:
        run.open()
        start = start_weights(run)
        run.step()
        first = run.checkpoint()
        run.step()
        run.finish()
        earlier = trained(run, start)
    finally:
        run.close()
    assert first.name == "gen-1"

    overrides = [*_tracking(tmp_path)[:-1], *settings, "run.name=resumed"]
    state = rl_training(TrainingRequest(config=str(TINY), overrides=overrides, resume_from=str(first)),
                        return_state=True)
    summary = state.result()
    flow_run_id = str(state.state_details.flow_run_id)
    assert summary["steps"] == 2 and len(summary["reward_per_step"]) == 1 and summary["eval_per_step"][0][0] == 1
    resumed = trained_from_folder(Path(summary["output_dir"]), cfg.algorithm.n_minibatches, None)
    assert_same_training(earlier, resumed)   # resumed == never interrupted, both trained
    assert _subflow_names(flow_run_id) == ["step-1"]
    assert sorted(p.name for p in (Path(summary["output_dir"]) / "checkpoints").glob("gen-*")) == ["gen-2"]
    deadline = time.monotonic() + 60
    lines, _ = _read(flow_run_id)
    while not any(STEP_LINE.match(line) for line in lines) and time.monotonic() < deadline:
        time.sleep(1)
        lines, _ = _read(flow_run_id)
    assert any(f"resuming from {first}" in line for line in lines), lines
    assert any(line.startswith("run open after ") and line.endswith("step 1 of 2 next") for line in lines), lines
    assert [line.split("  ")[0] for line in lines if STEP_LINE.match(line)] == ["step 1 of 2"], lines
    engine = open_database(f"sqlite:///{tmp_path}/tidal.db")
    with session_scope(engine) as s:
        (row,) = list_runs(s, prefect_flow_run_id=flow_run_id)
        assert row.status == "finished" and [st.step for st in list_steps(s, row.id)] == [1]
    engine.dispose()


def test_a_resume_from_no_checkpoint_fails_the_flow_run_before_any_run_exists(local_prefect, tmp_path, monkeypatch):
    """`resume_from` naming a folder with no checkpoint is refused by `open-run` (`preflight`, as `tidal train
    --resume` checks it) before any worker, run folder or record exists, naming the field."""
    from flows.rl_training import rl_training
    from tasks.requests import TrainingRequest
    from tidal.core.errors import TidalError
    monkeypatch.chdir(REPO)
    state = rl_training(TrainingRequest(config=str(TINY), overrides=_tracking(tmp_path),
                                        resume_from=str(tmp_path / "no-checkpoint-here")), return_state=True)
    assert state.is_failed()
    with pytest.raises(TidalError) as info:
        state.result()
    assert info.value.field == "resume_from" and "Fix:" in str(info.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tidal.db").exists()
