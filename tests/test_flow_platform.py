"""The platform as a flow run shows it: the database row links the flow run and the MLflow run.

Flows run in this process on a temporary local Prefect server (Prefect's own test harness: a real server and
database, nothing mocked); what the flow wrote is read back through the Prefect API, MLflow's client and the
platform database.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TELEMETRY = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}


@pytest.fixture(scope="module")
def local_prefect():
    """A temporary Prefect server and database for this module's flow runs (no PREFECT_API_URL needed)."""
    saved = {k: os.environ.get(k) for k in TELEMETRY}
    os.environ.update(TELEMETRY)
    from prefect.testing.utilities import prefect_test_harness
    try:
        with prefect_test_harness(server_startup_timeout=120):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
    tags = MlflowClient(tracking_uri=cfg.tracking.mlflow_uri).get_run(mlflow_run_id).data.tags
    assert tags["prefect.flow_run_id"] == flow_run_id and tags["tidal.db_run_id"] == str(db_run_id)
