"""Tracking of one training run: its MLflow run, its database row, and the config read the platform's way.

The same wiring as `tidal train`, as a value the flow's tasks (and the sweep's real trials) share::

    cfg = load_run_config("experiments/rlinf_dynamic.yaml", ["run.num_steps=2"])
    t = RunTracking.open(cfg, out_dir, policy="rlinf", parent_run_id=None)   # db row + MLflow run, linked
    run = TrainingRun(cfg, out_dir, t.sink, t.recorder)
    ...
    t.close("FINISHED", artifacts=[out_dir / "timeline.png"])             # MLflow status + db status
    # on an exception: t.close(closing_status(exc)); raise

How a run ends (`closing_status`, the `status` its driver passes to `close`): FINISHED when its code returned,
KILLED when it was stopped from outside, FAILED on any other exception. Stopped from outside, by what reaches the
driver's code:

    Ctrl-C, SIGINT                      KeyboardInterrupt
    SIGTERM to `tidal train`            tidal.cli.main.Terminated (a KeyboardInterrupt)
    a Prefect cancel                    prefect.exceptions.TerminationSignal: the runner sends the flow run's process
                                        SIGTERM, Prefect's handler (`capture_sigterm`) raises it in the flow's code
    an async flow's cancel              asyncio.CancelledError (Prefect re-raises it as TerminationSignal)
    the Prefect API aborts the run      prefect.exceptions.Abort; a cancelled subflow's result: CancelledRun

KILLED in MLflow is `aborted` in the database (`db.repository.STATUS_OF_MLFLOW`).

While a run is open, a heartbeat thread stamps its `runs.heartbeat_at` every HEARTBEAT_S; `open` first marks
`lost` every running run silent for LOST_AFTER_S (a driver that was killed, or whose machine went away).

Environment (a served worker points the platform at its services, see docker-compose.yml):
`TIDAL_DB_URL` -> `tracking.db_url`, `MLFLOW_TRACKING_URI` -> `tracking.mlflow_uri`. They apply before the
request's overrides, so an explicit override still wins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tidal.core.config import TidalConfig, flatten, load_config, public_dump
from tidal.core.errors import ConfigError
from tidal.tracking import MlflowSink, NullSink

#: environment variable -> config key it sets (before the caller's overrides)
ENV_KEYS = {"TIDAL_DB_URL": "tracking.db_url", "MLFLOW_TRACKING_URI": "tracking.mlflow_uri"}
HEARTBEAT_S = 10.0      # how often a driver stamps runs.heartbeat_at
LOST_AFTER_S = 120.0    # a running run silent this long has lost its driver (12 missed beats)
log = logging.getLogger("tidal.run")
#: exceptions that stop a run from outside (module doc), besides Prefect's (`_prefect_stops`)
STOPS: tuple[type[BaseException], ...] = (KeyboardInterrupt, asyncio.CancelledError)
#: the Prefect exceptions that stop a run from outside (module doc)
PREFECT_STOPS = ("TerminationSignal", "Abort", "CancelledRun")


def _prefect_stops() -> tuple[type[BaseException], ...]:
    """Prefect's exceptions of PREFECT_STOPS, where Prefect is loaded: an exception it raised can only exist then,
    so a driver without a flow never pays Prefect's import."""
    exceptions = sys.modules.get("prefect.exceptions")
    return tuple(getattr(exceptions, name) for name in PREFECT_STOPS) if exceptions is not None else ()


def closing_status(exc: BaseException) -> str:
    """The MLflow status a run ends with when `exc` ended it: KILLED when `exc` stops a run from outside (module
    doc), else FAILED. `exc` itself decides, not what it was raised from: `asyncio.wait_for`'s timeout is raised
    from a CancelledError, and a timeout is the run's failure."""
    return "KILLED" if isinstance(exc, STOPS + _prefect_stops()) else "FAILED"


@contextmanager
def closed_with_status(close: Callable[[str], None]) -> Iterator[None]:
    """Run the body, then `close(status)` in every case: FINISHED when it returns, `closing_status` of what
    ended it otherwise (re-raised)."""
    try:
        yield
    except BaseException as stop:   # a Prefect cancel (TerminationSignal), Ctrl-C: KILLED; an error: FAILED
        close(closing_status(stop))
        raise
    close("FINISHED")


def env_overrides() -> list[str]:
    return [f"{key}={os.environ[var]}" for var, key in ENV_KEYS.items() if os.environ.get(var)]


def load_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TidalConfig:
    return load_config(path, env_overrides() + list(overrides))


def run_dir(cfg: TidalConfig) -> Path:
    """Make and return this run's own folder `<run.output_dir>/<run.name>-<time>` (`-1`, `-2`... when runs start
    in the same second: `mkdir` claims a name atomically, so two runs never share one). Called before any record
    exists: a folder that cannot be made or written is a ConfigError naming run.output_dir."""
    root = Path(cfg.run.output_dir)
    base = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        for n in range(1000):
            out = root / (base if n == 0 else f"{base}-{n}")
            try:
                out.mkdir()
            except FileExistsError:
                continue
            (out / ".writable").touch()
            (out / ".writable").unlink()
            return out
    except OSError as err:
        raise ConfigError("run.output_dir", cfg.run.output_dir, f"cannot hold a run folder ({err.strerror})",
                          "point it at a writable folder with free space") from None
    raise ConfigError("run.output_dir", cfg.run.output_dir, f"already holds 1,000 runs named {base}",
                      "use another run.name or output_dir")


def policy_name(cfg: TidalConfig) -> str:
    return cfg.scheduler.policy if cfg.cluster.auto_scheduler else "static"


class Heartbeat:
    """A daemon thread that stamps the run's `heartbeat_at` every HEARTBEAT_S while the driver lives. A
    database hiccup is logged and retried on the next beat: the run itself never waits on it."""

    def __init__(self, engine: Any, run_id: int, every_s: float = HEARTBEAT_S):
        self._engine, self._run_id, self._every_s = engine, run_id, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tidal-heartbeat-{run_id}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        from db import repository as repo
        from db.session import session_scope
        while True:
            try:
                with session_scope(self._engine) as s:
                    repo.heartbeat(s, self._run_id)
            except Exception as err:  # noqa: BLE001 - a missed beat is not the run's failure
                log.warning("heartbeat of run %d not recorded: %s", self._run_id, err)
            if self._stop.wait(self._every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def mlflow_run_name(cfg: TidalConfig, out_dir: Path, policy: str) -> str:
    """`<run.name>-<policy>-<time>` (the time of the run's folder, `run_dir`): runs of one config under two
    policies, or twice, are told apart in MLflow's run list."""
    folder = Path(out_dir).name
    stamp = folder[len(cfg.run.name) + 1:] if folder.startswith(f"{cfg.run.name}-") else folder
    return f"{cfg.run.name}-{policy}-{stamp}"


@dataclass
class RunTracking:
    """The sink and recorder of one run, and the ids that link its MLflow run and its database row."""

    sink: Any                 # tidal.tracking.MetricsSink
    recorder: Any | None      # tidal.pipeline.recording.DbRecorder
    engine: Any | None
    db_run_id: int | None
    mlflow_run_id: str | None
    owns_sink: bool = True
    _beat: Heartbeat | None = None

    @classmethod
    def open(cls, cfg: TidalConfig, out_dir: Path, *, sink: Any = None, parent_run_id: str | None = None,
             tags: dict[str, str] | None = None, prefect_flow_run_id: str | None = None) -> RunTracking:
        """Database row first (its id goes into the MLflow tags), then the MLflow run (its id into the row). The
        run's tags: `tidal.policy` (what `tidal compare --group-by policy` groups by), `tidal.db_run_id`,
        `tidal.run_dir`, and `tags` (a sweep's trial: `tidal.sweep`, `tidal.trial`).
        `prefect_flow_run_id`: the flow run driving this run (a flow's tasks pass it): the row holds it beside the
        MLflow run's id, and the MLflow run holds it as the tag `prefect.flow_run_id`."""
        from db import repository as repo
        from db.migrate import open_database
        from db.session import session_scope
        from tidal.pipeline.recording import DbRecorder
        policy = policy_name(cfg)
        engine = open_database(cfg.tracking.db_url)
        with session_scope(engine) as s:
            lost = repo.mark_lost(s, stale_after_s=LOST_AFTER_S)   # drivers that died without a word
            for run in lost:
                log.warning("run %d (%s) marked lost: no heartbeat since %s", run.id, run.name, run.ended_at)
            lost_mlflow = [run.mlflow_run_id for run in lost if run.mlflow_run_id]
            db_id = repo.add_run(s, name=cfg.run.name, config=public_dump(cfg), output_dir=str(out_dir),
                                 prefect_flow_run_id=prefect_flow_run_id).id
        owns = sink is None
        sink = sink or MlflowSink.from_config(cfg.tracking)
        for lost_id in lost_mlflow if isinstance(sink, MlflowSink) else []:   # the same story in MLflow
            sink.end_lost_run(lost_id)
        mlflow_id = sink.start_run(mlflow_run_name(cfg, out_dir, policy), flatten(cfg),
                                   {"tidal.policy": policy, "tidal.db_run_id": str(db_id),
                                    "tidal.run_dir": str(out_dir),
                                    **({"prefect.flow_run_id": prefect_flow_run_id} if prefect_flow_run_id else {}),
                                    **(tags or {})}, parent_run_id=parent_run_id)
        with session_scope(engine) as s:
            repo.attach_mlflow_run(s, db_id, mlflow_id)
        tracking = cls(sink, DbRecorder(engine, db_id, policy), engine, db_id, mlflow_id, owns)
        tracking._beat = Heartbeat(engine, db_id)
        return tracking

    @classmethod
    def null(cls, cfg: TidalConfig) -> RunTracking:
        """No MLflow, no database: values stay in memory (`NullSink`)."""
        sink = NullSink()
        return cls(sink, None, None, None, sink.start_run(cfg.run.name, flatten(cfg)))

    def close(self, status: str, artifacts: Sequence[Path] = ()) -> None:
        """End the MLflow run with `status` (FINISHED, FAILED, KILLED; on an exception `closing_status`) and the
        database row with its word for it (`db.repository.STATUS_OF_MLFLOW`: KILLED is `aborted`)."""
        if status == "FINISHED":
            for path in artifacts:
                if Path(path).is_file():
                    self.sink.log_artifact(path)
        self.sink.end_run(status)
        if self._beat is not None:
            self._beat.stop()
            self._beat = None
        if self.engine is not None:
            from db import repository as repo
            from db.session import session_scope
            with session_scope(self.engine) as s:   # `open` sets the engine and the row's id together
                repo.finish_run(s, cast(int, self.db_run_id), status=repo.status_of_mlflow(status))
            self.engine.dispose()
            self.engine = None
