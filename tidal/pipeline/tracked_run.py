"""Tracking of one training run: its MLflow run, its database row, and the config read the platform's way.

The same wiring as `tidal train`, as a value the flow's tasks (and the sweep's real trials) share::

    cfg = load_run_config("experiments/rlinf_dynamic.yaml", ["run.num_steps=2"])
    t = RunTracking.open(cfg, out_dir, policy="rlinf", parent_run_id=None)   # db row + MLflow run, linked
    run = TrainingRun(cfg, out_dir, t.sink, t.recorder)
    ...
    t.close("FINISHED", artifacts=[out_dir / "timeline.png"])             # MLflow status + db status

Environment (a served worker points the platform at its services, see docker-compose.yml):
`TIDAL_DB_URL` -> `tracking.db_url`, `MLFLOW_TRACKING_URI` -> `tracking.mlflow_uri`. They apply before the
request's overrides, so an explicit override still wins.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tidal.core.config import TidalConfig, flatten, load_config, public_dump
from tidal.tracking import MlflowSink, NullSink

#: environment variable -> config key it sets (before the caller's overrides)
ENV_KEYS = {"TIDAL_DB_URL": "tracking.db_url", "MLFLOW_TRACKING_URI": "tracking.mlflow_uri"}
_STATUS_DB = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "aborted"}


def env_overrides() -> list[str]:
    return [f"{key}={os.environ[var]}" for var, key in ENV_KEYS.items() if os.environ.get(var)]


def load_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TidalConfig:
    return load_config(path, env_overrides() + list(overrides))


def run_dir(cfg: TidalConfig) -> Path:
    """`<run.output_dir>/<run.name>-<time>` (a suffix if two runs start within the same second)."""
    base = Path(cfg.run.output_dir) / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        out, n = base.with_name(f"{base.name}-{n}"), n + 1
    return out


def policy_name(cfg: TidalConfig) -> str:
    return cfg.scheduler.policy if cfg.cluster.auto_scheduler else "static"


@dataclass
class RunTracking:
    """The sink and recorder of one run, and the ids that link its MLflow run and its database row."""

    sink: Any                 # tidal.tracking.MetricsSink
    recorder: Any | None      # tidal.pipeline.recording.DbRecorder
    engine: Any | None
    db_run_id: int | None
    mlflow_run_id: str | None
    owns_sink: bool = True

    @classmethod
    def open(cls, cfg: TidalConfig, out_dir: Path, *, sink: Any = None, parent_run_id: str | None = None,
             tags: dict[str, str] | None = None) -> RunTracking:
        """Database row first (its id goes into the MLflow tags), then the MLflow run (its id into the row)."""
        from db import repository as repo
        from db.migrate import open_database
        from db.session import session_scope
        from tidal.pipeline.recording import DbRecorder
        policy = policy_name(cfg)
        engine = open_database(cfg.tracking.db_url)
        with session_scope(engine) as s:
            db_id = repo.add_run(s, name=cfg.run.name, config=public_dump(cfg), output_dir=str(out_dir)).id
        owns = sink is None
        sink = sink or MlflowSink.from_config(cfg.tracking)
        mlflow_id = sink.start_run(cfg.run.name, flatten(cfg), {"policy": policy, "tidal.db_run_id": str(db_id),
                                                               **(tags or {})}, parent_run_id=parent_run_id)
        with session_scope(engine) as s:
            repo.attach_mlflow_run(s, db_id, mlflow_id)
        return cls(sink, DbRecorder(engine, db_id, policy), engine, db_id, mlflow_id, owns)

    @classmethod
    def null(cls, cfg: TidalConfig) -> RunTracking:
        """No MLflow, no database: values stay in memory (`NullSink`)."""
        sink = NullSink()
        return cls(sink, None, None, None, sink.start_run(cfg.run.name, flatten(cfg)))

    def close(self, status: str, artifacts: Sequence[Path] = ()) -> None:
        """End the MLflow run with `status` (FINISHED, FAILED, KILLED) and the database row likewise."""
        if status == "FINISHED":
            for path in artifacts:
                if Path(path).is_file():
                    self.sink.log_artifact(path)
        self.sink.end_run(status)
        if self.engine is not None:
            from db import repository as repo
            from db.session import session_scope
            with session_scope(self.engine) as s:   # `open` sets the engine and the row's id together
                repo.finish_run(s, cast(int, self.db_run_id), status=_STATUS_DB[status])
            self.engine.dispose()
            self.engine = None
