"""The one metrics sink: components return metric dicts, this module writes them to MLflow.

Library code never imports mlflow. A component returns plain values (`{"reshard/bytes": 1.2e9,
"reshard/seconds": 0.4}`) or typed event records; the flow hands them to a `MetricsSink`:

    sink = MlflowSink.from_config(cfg.tracking)          # sqlite:///mlruns.db, no server needed
    run_id = sink.start_run(cfg.run.name, flatten(cfg), tags={"policy": "tidal"})
    sink.log_metrics({"train/loss": 0.7, "sched/idle_gpu_s": 3.1}, step=1)
    sink.log_event("reshard", {"step": 1, "bytes": 1.2e9, "from": "tp1dp2", "to": "tp1dp4"})
    sink.log_artifact("runs/x/timeline.png")
    sink.end_run("FINISHED")                              # also writes events.json

    NullSink()                                            # tests: writes nowhere, keeps values in memory

Runs form a stack per sink. `start_run(..., parent_run_id=p)` makes an MLflow nested run (tag
`mlflow.parentRunId`), which is how a sweep shows its trials under one parent; `log_*` go to the top of the
stack, `end_run` pops it, so after a trial ends the sweep's own metrics go to the parent again:

    start_run("sweep")                 -> P     stack [P]
      start_run("trial-0", parent=P)   -> C0    stack [P, C0]   log_metrics -> C0
      end_run()                                 stack [P]       log_metrics -> P

Events: `log_event(kind, record)` writes each numeric field of the record that is a measurement (its name
ends in a unit or a quantity: `MEASURES`, e.g. `seconds`, `bytes`, `tokens`; ids, layouts, versions and
timestamps are not metrics) as the metric `kind/field` (at the record's `step` if it has one, else at the last
step given to `log_metrics`), counts events per kind
(`events/kind`), and keeps the whole record for the run's `events.json` artifact: a JSON list of
`{"kind", "time", "step", "record"}`, rewritten when the run ends and at most every `flush_every_s` while it runs
(so a crashed run still shows its events up to the last flush).

Names: MLflow accepts metric, param and tag keys made of letters, digits, `_ - . space : /` that are not
path-like (`a//b`, `./a`, `a/..`), up to 250 characters. `sanitize_key` maps any key onto that set
(bad characters become `_`, empty and dot components are dropped) so a component's key never fails a run.

Artifacts: the experiment is created with an explicit artifact location (`tracking.mlflow_artifacts`, a
directory, made absolute) so files land where the config says, not in the current directory. With an
`http(s)://` tracking server a plain directory is left to the server (its `--artifacts-destination`).
An experiment that already exists keeps the location it was created with (MLflow cannot move it); the sink
exposes it as `artifact_root`.

Telemetry: `MLFLOW_DISABLE_TELEMETRY=true` is set before mlflow is first imported here (mlflow reads it at
each call, so setting it before use suffices); an explicit value in the environment is left alone.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
import posixpath
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, is_dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rich.console import Console
from rich.table import Table

from tidal.core.config import TrackingConfig
from tidal.core.errors import TidalError

if TYPE_CHECKING:  # mlflow is imported lazily: importing tidal.tracking for NullSink must stay cheap
    from mlflow.tracking import MlflowClient

MAX_KEY_LEN = 250            # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_PARAMS_PER_BATCH = 100   # MAX_PARAMS_TAGS_PER_BATCH
MAX_METRICS_PER_BATCH = 1000
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
EVENTS_ARTIFACT = "events.json"
_BAD_CHARS = re.compile(r"[^\w.\- :/]")


def sanitize_key(key: object) -> str:
    """A metric/param/tag name MLflow accepts, as close to `key` as possible."""
    text = _BAD_CHARS.sub("_", str(key))
    parts = [p for p in text.split("/") if p not in ("", ".")]
    parts = ["_" if p == ".." else p for p in parts]
    out = "/".join(parts) or "_"
    out = out[:MAX_KEY_LEN].rstrip("/")
    assert posixpath.normpath(out) == out, out  # our invariant: MLflow's path check passes
    return out


def _metric_value(key: str, value: object) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r} has non-numeric value {value!r} ({type(value).__name__}); "
                    "metrics are numbers: put text in an event record or a tag")


def _jsonable(obj: object) -> object:
    """`json.dumps` default: records may hold enums, paths, tuples, dataclasses."""
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if isinstance(obj, numbers.Real):
        return float(obj)
    return str(obj)


def _strict_json(obj: Any) -> Any:
    """NaN/inf -> None: events.json stays standard JSON (browsers' JSON.parse rejects NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict_json(v) for v in obj]
    return obj


def _param_value(value: object) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=_jsonable)


@dataclass(frozen=True)
class Event:
    """One entry of `events.json`."""

    kind: str
    time: float            # unix seconds when logged
    step: int | None       # RL step the event belongs to, if known
    record: dict[str, Any]


@runtime_checkable
class MetricsSink(Protocol):
    """Where returned metric values go. One per driver process; runs nest (see module doc)."""

    def start_run(self, name: str, params: Mapping[str, object], tags: Mapping[str, str] | None = None,
                  parent_run_id: str | None = None) -> str: ...

    def log_metrics(self, metrics: Mapping[str, object], step: int) -> None: ...

    def log_event(self, kind: str, record: Mapping[str, object]) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def set_tag(self, key: str, value: object) -> None: ...

    def end_run(self, status: str = "FINISHED") -> None: ...


@dataclass
class _RunState:
    run_id: str
    events: list[Event] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    last_step: int = 0
    last_flush: float = field(default_factory=time.monotonic)
    dirty: bool = False


class _EventsMixin:
    """Event bookkeeping shared by both sinks: metrics derived from a record, the JSON list."""

    _stack: list[_RunState]  # both sinks keep `_stack`, the open runs (innermost last)

    @property
    def run_id(self) -> str | None:
        return self._stack[-1].run_id if self._stack else None

    def _top(self) -> _RunState:
        if not self._stack:
            raise RuntimeError("no active run: call start_run first")
        return self._stack[-1]

    @staticmethod
    def _event_metrics(state: _RunState, kind: str, record: Mapping[str, object]) -> tuple[Event, dict, int]:
        raw_step = record.get("step")
        step = int(raw_step) if isinstance(raw_step, numbers.Integral) and not isinstance(raw_step, bool) \
            else None
        metric_step = state.last_step if step is None else step
        state.counts[kind] = state.counts.get(kind, 0) + 1
        metrics: dict[str, float] = {f"events/{kind}": float(state.counts[kind])}
        for k, v in record.items():
            if k == "step" or isinstance(v, bool) or not isinstance(v, numbers.Real) or not is_measure(str(k)):
                continue
            name = k if str(k).startswith(f"{kind}/") else f"{kind}/{k}"
            metrics[name] = float(v)
        rec = _strict_json(json.loads(json.dumps(dict(record), default=_jsonable)))  # detached, JSON-safe copy
        ev = Event(kind=kind, time=time.time(), step=step, record=rec)
        state.events.append(ev)
        state.dirty = True
        return ev, metrics, metric_step


#: endings of an event field that is a measurement (a metric); other numbers (device ids, layouts, versions,
#: iter numbers, timestamps) stay in events.json only
MEASURES = ("seconds", "_s", "bytes", "_sent", "_moved", "tokens", "requests", "groups", "rate", "fraction",
            "_frac", "resident", "peak", "allocated")


def is_measure(field: str) -> bool:
    return field.rsplit("/", 1)[-1].endswith(MEASURES)


def events_json(events: list[Event]) -> str:
    return json.dumps([asdict(e) for e in events], indent=1, default=_jsonable, allow_nan=False)


class NullSink(_EventsMixin):
    """Writes nothing anywhere; keeps what it was given in memory so tests can assert on it."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}
        self._stack: list[_RunState] = []

    def start_run(self, name, params, tags=None, parent_run_id=None) -> str:
        run_id = f"null-{len(self.runs)}"
        self.runs[run_id] = {"name": name, "params": {sanitize_key(k): _param_value(v) for k, v in params.items()},
                             "tags": dict(tags or {}), "parent": parent_run_id, "metrics": [], "events": [],
                             "artifacts": [], "status": "RUNNING"}
        self._stack.append(_RunState(run_id))
        return run_id

    def log_metrics(self, metrics, step) -> None:
        top = self._top()
        top.last_step = int(step)
        for k, v in metrics.items():
            self.runs[top.run_id]["metrics"].append((sanitize_key(k), _metric_value(k, v), int(step)))

    def log_event(self, kind, record) -> None:
        top = self._top()
        ev, metrics, step = self._event_metrics(top, kind, record)
        self.runs[top.run_id]["events"].append(ev)
        for k, v in metrics.items():
            self.runs[top.run_id]["metrics"].append((sanitize_key(k), v, step))

    def log_artifact(self, path, artifact_path=None) -> None:
        self.runs[self._top().run_id]["artifacts"].append((str(path), artifact_path))

    def set_tag(self, key, value) -> None:
        self.runs[self._top().run_id]["tags"][sanitize_key(key)] = str(value)

    def end_run(self, status="FINISHED") -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"run status {status!r} is not one of {RUN_STATUSES}")
        self.runs[self._stack.pop().run_id]["status"] = status


def _import_mlflow_client() -> type:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient
    return MlflowClient


def _is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def artifact_location(uri: str, artifacts: str | None) -> str | None:
    """Where the experiment's artifacts go: an absolute file URI for a directory, a URI as given."""
    if not artifacts:
        return None
    if "://" in artifacts or artifacts.startswith("mlflow-artifacts:"):
        return artifacts
    if _is_server(uri):
        return None  # the server decides (its --artifacts-destination, proxied)
    return Path(artifacts).expanduser().resolve().as_uri()


class MlflowSink(_EventsMixin):
    """`MetricsSink` over an MLflow tracking store (sqlite:///... needs no server). Thread-safe."""

    def __init__(self, uri: str, experiment: str, artifacts: str | None = None, flush_every_s: float = 30.0):
        self.uri, self.experiment_name, self.flush_every_s = uri, experiment, flush_every_s
        self._client: MlflowClient = _import_mlflow_client()(tracking_uri=uri)
        self._lock = threading.RLock()
        self._stack: list[_RunState] = []
        exp = self._client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self._client.create_experiment(experiment,
                                                                artifact_location=artifact_location(uri, artifacts))
        else:
            self.experiment_id = exp.experiment_id
        self.artifact_root = self._client.get_experiment(self.experiment_id).artifact_location

    @classmethod
    def from_config(cls, tracking: Any, flush_every_s: float = 30.0) -> MlflowSink:
        """Build from a `TrackingConfig` (`mlflow_uri`, `mlflow_artifacts`, `experiment`)."""
        return cls(tracking.mlflow_uri, tracking.experiment, tracking.mlflow_artifacts, flush_every_s)

    @property
    def client(self) -> MlflowClient:
        return self._client

    def start_run(self, name: str, params: Mapping[str, object], tags: Mapping[str, str] | None = None,
                  parent_run_id: str | None = None) -> str:
        from mlflow.entities import Param
        run_tags = {sanitize_key(k): str(v) for k, v in (tags or {}).items()}
        if parent_run_id is not None:
            run_tags["mlflow.parentRunId"] = parent_run_id
        with self._lock:
            run = self._client.create_run(self.experiment_id, run_name=name, tags=run_tags)
            run_id = run.info.run_id
            clean: dict[str, str] = {}
            for k, v in params.items():
                key = sanitize_key(k)
                if key in clean and clean[key] != _param_value(v):
                    raise ValueError(f"params {k!r} and another key both map to MLflow name {key!r}")
                clean[key] = _param_value(v)
            items = [Param(k, v) for k, v in clean.items()]
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
                self._client.log_batch(run_id, params=items[i:i + MAX_PARAMS_PER_BATCH])
            self._stack.append(_RunState(run_id))
        return run_id

    def _write_metrics(self, run_id: str, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        items = [Metric(sanitize_key(k), v, now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=items[i:i + MAX_METRICS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, object], step: int) -> None:
        values = {k: _metric_value(k, v) for k, v in metrics.items()}
        with self._lock:
            top = self._top()
            top.last_step = int(step)
            self._write_metrics(top.run_id, values, step)

    def log_event(self, kind: str, record: Mapping[str, object]) -> None:
        with self._lock:
            top = self._top()
            _, metrics, step = self._event_metrics(top, sanitize_key(kind), record)
            self._write_metrics(top.run_id, metrics, step)
            if time.monotonic() - top.last_flush >= self.flush_every_s:
                self._flush(top)

    def _flush(self, state: _RunState) -> None:
        self._client.log_text(state.run_id, events_json(state.events), EVENTS_ARTIFACT)
        state.last_flush, state.dirty = time.monotonic(), False

    def flush(self) -> None:
        """Write the current run's events.json now."""
        with self._lock:
            self._flush(self._top())

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"artifact {str(p)!r} does not exist")
        with self._lock:
            self._client.log_artifact(self._top().run_id, str(p), artifact_path)

    def set_tag(self, key: str, value: object) -> None:
        with self._lock:
            self._client.set_tag(self._top().run_id, sanitize_key(key), str(value))

    def end_run(self, status: str = "FINISHED") -> None:
        if status not in RUN_STATUSES:
            raise ValueError(f"run status {status!r} is not one of {RUN_STATUSES}")
        with self._lock:
            top = self._top()
            if top.events or top.dirty:
                self._flush(top)
            self._client.set_terminated(top.run_id, status)
            self._stack.pop()

    def close(self) -> None:
        """End runs left open (a driver that died mid-run) as KILLED."""
        while self._stack:
            self.end_run("KILLED")

    def __enter__(self) -> MlflowSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def tracked_run(sink: MetricsSink, name: str, params: Mapping[str, object], tags: Mapping[str, str] | None = None,
                parent_run_id: str | None = None) -> Iterator[str]:
    """`with tracked_run(sink, ...) as run_id:` ends FINISHED, FAILED on an exception, KILLED on Ctrl-C."""
    run_id = sink.start_run(name, params, tags, parent_run_id)
    try:
        yield run_id
    except KeyboardInterrupt:
        sink.end_run("KILLED")
        raise
    except BaseException:
        sink.end_run("FAILED")
        raise
    sink.end_run("FINISHED")


# ---- compare ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CompareRow:
    """One row of `tidal compare`: section is "run", "param" or "metric"; one value per run (None: absent)."""

    section: str
    key: str
    values: tuple[object, ...]
    stats: tuple[tuple[float, float, float] | None, ...] = ()
    """Metrics: per run (mean, min, max) over every logged step, None where the run logged it once or never:
    a final value alone can mislead (one slow last step hides a fast run)."""


def _check_store(uri: str) -> None:
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_file():
            raise TidalError("--uri", uri, "no MLflow store at this path",
                             "pass --uri sqlite:///path/to/mlruns.db (tracking.mlflow_uri of the runs)")


def compare_runs(run_ids: list[str], uri: str, all_params: bool = False) -> list[CompareRow]:
    """Rows for a side-by-side table: run info, params that differ (all with `all_params` or one run), and
    each metric's final value (MLflow's latest by step)."""
    if not run_ids:
        raise TidalError("RUN", "", "no run ids given", "pass one or more MLflow run ids")
    _check_store(uri)
    client = _import_mlflow_client()(tracking_uri=uri)
    from mlflow.exceptions import MlflowException
    runs = []
    for rid in run_ids:
        try:
            runs.append(client.get_run(rid))
        except MlflowException:
            raise TidalError("RUN", rid, f"no such run in {uri}",
                             "copy the run id from the MLflow UI or `tidal train`'s output") from None
    rows: list[CompareRow] = []
    for key, get in (("name", lambda r: r.info.run_name), ("status", lambda r: r.info.status),
                     ("parent", lambda r: r.data.tags.get("mlflow.parentRunId")),
                     ("duration_s", lambda r: None if r.info.end_time is None or r.info.start_time is None
                      else round((r.info.end_time - r.info.start_time) / 1000.0, 1))):
        rows.append(CompareRow("run", key, tuple(get(r) for r in runs)))
    if not any(rows[2].values):
        rows.pop(2)
    for key in sorted(set().union(*(r.data.params for r in runs))):
        vals = tuple(r.data.params.get(key) for r in runs)
        if all_params or len(runs) == 1 or len(set(vals)) > 1:
            rows.append(CompareRow("param", key, vals))
    for key in sorted(set().union(*(r.data.metrics for r in runs))):
        stats = []
        for r in runs:
            hist = [m.value for m in client.get_metric_history(r.info.run_id, key)] if key in r.data.metrics else []
            stats.append((sum(hist) / len(hist), min(hist), max(hist)) if len(hist) > 1 else None)
        rows.append(CompareRow("metric", key, tuple(r.data.metrics.get(key) for r in runs), tuple(stats)))
    return rows


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.6g}"
    return str(v)


def print_comparison(run_ids: list[str], rows: list[CompareRow], console: Any = None) -> None:
    console = console or Console()
    table = Table(title="runs compared", show_lines=False)
    table.add_column("", style="dim")
    table.add_column("key")
    for rid in run_ids:
        table.add_column(rid[:8], justify="right")
    section = None
    for row in rows:
        if section is not None and row.section != section:
            table.add_section()
        section = row.section
        cells = [_fmt(v) for v in row.values]
        distinct = len(set(cells)) > 1
        cells = [c if not st else f"{c}  (mean {_fmt(st[0])}, {_fmt(st[1])}..{_fmt(st[2])})"
                 for c, st in zip(cells, row.stats or (None,) * len(cells))]
        table.add_row(row.section, row.key, *[f"[bold]{c}[/]" if distinct and row.section == "metric" else c
                                              for c in cells])
    console.print(table)


def compare_main(argv: list[str]) -> int:
    """`tidal compare RUN... [--uri URI] [--all-params]`."""

    default_uri = os.environ.get("MLFLOW_TRACKING_URI") or TrackingConfig.model_fields["mlflow_uri"].default
    ap = argparse.ArgumentParser(prog="tidal compare",
                                 description="Side-by-side table of MLflow runs: params that differ, each metric's "
                                             "final value with its mean and min..max over the logged steps.")
    ap.add_argument("runs", nargs="+", metavar="RUN", help="MLflow run ids")
    ap.add_argument("--uri", default=default_uri,
                    help=f"tracking URI (default: $MLFLOW_TRACKING_URI or {default_uri})")
    ap.add_argument("--all-params", action="store_true", help="show every param, not only those that differ")
    args = ap.parse_args(argv)
    rows = compare_runs(args.runs, args.uri, all_params=args.all_params)
    print_comparison(args.runs, rows)
    return 0
