"""The one metrics sink: components return metric dicts, this module writes them to MLflow.

Library code never imports mlflow. A component returns plain values (`{"reshard/total_bytes": 1.2e9,
"step/time_s": 4.1}`) or typed event records; the flow hands them to a `MetricsSink`:

    sink = MlflowSink.from_config(cfg.tracking)          # sqlite:///mlruns.db, no server needed
    run_id = sink.start_run(cfg.run.name, flatten(cfg), tags={"tidal.policy": "tidal"})
    sink.log_metrics({"train/loss": 0.7, "sched/idle_gpu_s": 3.1}, step=1)
    sink.log_metrics({"devices/actor": 6}, step=1, timestamp=1764412345.2)   # at a wall time of its own
    sink.log_event("reshard", {"step": 1, "seconds": 0.4, "from": "tp=1,dp=2", "to": "tp=1,dp=4"})
    sink.log_artifact("runs/x/timeline.png")
    sink.end_run("FINISHED")                              # also writes events_table.json

    NullSink()                                            # tests: writes nowhere, keeps values in memory

Runs form a stack per sink. `start_run(..., parent_run_id=p)` makes an MLflow nested run (tag
`mlflow.parentRunId`), which is how a sweep shows its trials under one parent; `log_*` go to the top of the
stack, `end_run` pops it, so after a trial ends the sweep's own metrics go to the parent again:

    start_run("sweep")                 -> P     stack [P]
      start_run("trial-0", parent=P)   -> C0    stack [P, C0]   log_metrics -> C0
      end_run()                                 stack [P]       log_metrics -> P

Metric names state their unit (`_s` wall seconds, `_device_s` seconds summed over devices, `_instance_s` over
rollout instances, `_bytes`, `_tokens`, `_per_s`) or are dimensionless by name (reward, accuracy, fraction,
count); docs/platform.md lists every metric a run logs. `timestamp` (unix seconds) places a value on MLflow's
wall-time axis: a series that changes between steps (the devices each component holds) reads true on the
"Time" x-axis.

Events: `log_event(kind, record)` writes no metric. A step holds several events of a kind (reshards, actions),
so a metric per event field would put several values on one step (a sawtooth in MLflow's step charts); the
caller logs per-step aggregates instead (`tidal.pipeline.run_metrics.step_event_metrics`: `reshard/count`,
`reshard/total_s`, ...). Each record becomes one row of the run's events table, `events_table.json`, an MLflow
table (`MlflowClient.load_table(experiment_id, "events_table.json", run_ids)` reads it, runs side by side):

    t_s   step iter kind     component what devices from                   to                   seconds bytes
    7.79  1    0    reshard  actor          0       tp=1,dp=2,devices=0-1  tp=1,dp=1,devices=0  0.033   118848
    7.50  1    1    action   inference ReleaseInference 6,7 inference         free                 0.004
    (then ok, reason, and detail: the record's other fields as JSON; ids, versions, per-phase seconds)

`t_s` is the record's `time` (the pipeline's clock: seconds since the run started) or, for a record without
one, seconds since its MLflow run started. The table is rewritten when the run ends and at most every
`flush_every_s` while it runs (so a crashed run still shows its events up to the last flush).

Names: MLflow accepts metric, param and tag keys made of letters, digits, `_ - . space : /` that are not
path-like (`a//b`, `./a`, `a/..`), up to 250 characters. `sanitize_key` maps any key onto that set
(bad characters become `_`, empty and dot components are dropped) so a component's key never fails a run.

Artifacts: the experiment is created with an explicit artifact location (`tracking.mlflow_artifacts`, a
directory, made absolute) so files land where the config says, not in the current directory. With an
`http(s)://` tracking server a plain directory is left to the server (its `--artifacts-destination`).
An experiment that already exists keeps the location it was created with (MLflow cannot move it); the sink
exposes it as `artifact_root`.

Experiment kind and links: MLflow 3's UI opens an experiment either as a GenAI app (traces, tokens, cost) or for
model training (runs, metrics, charts). It keeps the choice in the experiment tag `mlflow.experimentKind`
(`EXPERIMENT_KIND_TAG`) and, per page, in the `workflowType` query of the page's address (with no query: the
browser's last choice, GenAI at first). Every experiment a sink opens carries the tag (set when the sink creates
it, added when an existing one has none or only an inferred one; a kind a person chose stays), and every page
address Tidal gives (`ui_run_url`, `run_url`) carries `?workflowType=machine_learning`, so a link lands on the
run in the model-training view. A run's description (`NOTE_TAG`, markdown the run page renders) holds the way
back to the Prefect flow run that drives it (`flow_run_note`).

Reading runs back (`tidal compare`, `tidal/cli/compare.py`): `store_client(uri)` and `find_run(client, id)` keep
mlflow's imports here. Runs carry the tags it groups by: `tidal.policy`, and on a sweep's trials `tidal.sweep`
(the study) and `tidal.trial` (its number).

Telemetry: `MLFLOW_DISABLE_TELEMETRY=true` is set before mlflow is first imported here (mlflow reads it at
each call, so setting it before use suffices); an explicit value in the environment is left alone.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import posixpath
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, is_dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tidal.core.errors import TidalError

if TYPE_CHECKING:  # mlflow is imported lazily: importing tidal.tracking for NullSink must stay cheap
    from mlflow.tracking import MlflowClient

MAX_KEY_LEN = 250            # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_PARAMS_PER_BATCH = 100   # MAX_PARAMS_TAGS_PER_BATCH
MAX_METRICS_PER_BATCH = 1000
RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
EVENTS_TABLE = "events_table.json"
#: the experiment tag in which MLflow 3 keeps an experiment's kind, and the kind of Tidal's (model training)
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
CHOSEN_KINDS = (EXPERIMENT_KIND, "genai_development")   # the kinds the UI's selector sets (others are inferred)
#: the query that opens an MLflow 3 page in the model-training view whatever the browser chose last
MODEL_TRAINING_VIEW = "workflowType=machine_learning"
#: the run tag MLflow shows (markdown, rendered) as the run's description
NOTE_TAG = "mlflow.note.content"
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
    """NaN/inf -> None: the events table stays standard JSON (browsers' JSON.parse rejects NaN)."""
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
    """One event as logged: a row of the events table."""

    kind: str
    time: float            # unix seconds when logged
    step: int | None       # RL step the event belongs to, if known
    record: dict[str, Any]


@runtime_checkable
class MetricsSink(Protocol):
    """Where returned metric values go. One per driver process; runs nest (see module doc)."""

    def start_run(self, name: str, params: Mapping[str, object], tags: Mapping[str, str] | None = None,
                  parent_run_id: str | None = None) -> str: ...

    def log_metrics(self, metrics: Mapping[str, object], step: int, timestamp: float | None = None) -> None: ...

    def log_event(self, kind: str, record: Mapping[str, object]) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def set_tag(self, key: str, value: object) -> None: ...

    def end_run(self, status: str = "FINISHED") -> None: ...


@dataclass
class _RunState:
    run_id: str
    started: float = field(default_factory=time.time)   # unix seconds: `t_s` of records without a `time`
    events: list[Event] = field(default_factory=list)
    last_flush: float = field(default_factory=time.monotonic)
    dirty: bool = False
    tagged: bool = False   # the run's `mlflow.loggedArtifacts` tag lists the events table


#: columns of the events table, in order; a record's other fields go to `detail` (JSON)
EVENT_COLUMNS = ("t_s", "step", "iter", "kind", "component", "what", "devices", "from", "to", "seconds", "bytes",
                 "ok", "reason", "detail")
_NOT_DETAIL = frozenset(EVENT_COLUMNS) | {"time"}


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) else None


def _text(v: object) -> str:
    if v is None:
        return ""
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def wave_heads(rows: Sequence[tuple[str, Mapping[str, Any]]]) -> list[bool]:
    """For each (kind, record) in log order, whether its `seconds` start a duration of their own: False only for
    the second and later moves of a migration wave. A wave's moves ran at once and each record carries the wave's
    wall `seconds`; the actuator marks the wave's first recorded move `wave_first` (`tidal.pipeline.actuator`).
    Summing `seconds` over the heads counts each wave once: what the events table shows and what
    `migration/total_s` sums (`tidal.pipeline.run_metrics.step_event_metrics`)."""
    return [kind != "migration" or rec.get("wave_first", True) is not False for kind, rec in rows]


def event_row(ev: Event, started: float, head: bool = True) -> list[Any]:
    """`ev` as a row of EVENT_COLUMNS (`started`: unix seconds of its run's start, for a record without `time`).
    `head` False (a later move of a migration wave, `wave_heads`): `seconds` empty, the wave's first row holds
    them; `detail` keeps `wave`, the number of moves that share them."""
    rec = ev.record
    t = _number(rec.get("time"))
    it = rec.get("iter")
    ok = rec.get("ok")
    detail = {k: v for k, v in rec.items() if k not in _NOT_DETAIL}
    return [round(t if t is not None else ev.time - started, 4), ev.step,
            int(it) if isinstance(it, numbers.Integral) and not isinstance(it, bool) else None, ev.kind,
            _text(rec.get("component")), _text(rec.get("what")), _text(rec.get("devices")), _text(rec.get("from")),
            _text(rec.get("to")), _number(rec.get("seconds")) if head else None, _number(rec.get("bytes")),
            ok if isinstance(ok, bool) else None, _text(rec.get("reason")),
            json.dumps(detail, sort_keys=True, allow_nan=False) if detail else ""]


def events_table(events: list[Event], started: float) -> str:
    """The events table as MLflow stores a table: pandas' split orient, `{"columns": [...], "data": [[...]]}`.
    A migration wave's seconds stand once, on its first row (`wave_heads`), so the `seconds` column sums to
    wall seconds."""
    heads = wave_heads([(e.kind, e.record) for e in events])
    return json.dumps({"columns": list(EVENT_COLUMNS),
                       "data": [event_row(e, started, head) for e, head in zip(events, heads)]}, allow_nan=False)


class _EventsMixin:
    """Event bookkeeping shared by both sinks."""

    _stack: list[_RunState]  # both sinks keep `_stack`, the open runs (innermost last)

    @property
    def run_id(self) -> str | None:
        return self._stack[-1].run_id if self._stack else None

    def _top(self) -> _RunState:
        if not self._stack:
            raise RuntimeError("no active run: call start_run first")
        return self._stack[-1]

    @staticmethod
    def _add_event(state: _RunState, kind: str, record: Mapping[str, object]) -> Event:
        raw_step = record.get("step")
        step = int(raw_step) if isinstance(raw_step, numbers.Integral) and not isinstance(raw_step, bool) \
            else None
        rec = _strict_json(json.loads(json.dumps(dict(record), default=_jsonable)))  # detached, JSON-safe copy
        ev = Event(kind=kind, time=time.time(), step=step, record=rec)
        state.events.append(ev)
        state.dirty = True
        return ev


class NullSink(_EventsMixin):
    """Writes nothing anywhere; keeps what it was given in memory so tests can assert on it. A metric is kept
    as (name, value, step), or (name, value, step, timestamp) when logged with one."""

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

    def log_metrics(self, metrics, step, timestamp=None) -> None:
        top = self._top()
        for k, v in metrics.items():
            row = (sanitize_key(k), _metric_value(k, v), int(step))
            self.runs[top.run_id]["metrics"].append(row if timestamp is None else (*row, float(timestamp)))

    def log_event(self, kind, record) -> None:
        top = self._top()
        self.runs[top.run_id]["events"].append(self._add_event(top, sanitize_key(kind), record))

    def table(self) -> dict[str, Any]:
        """The current run's events table, as `events_table.json` would hold it."""
        top = self._top()
        return json.loads(events_table(top.events, top.started))

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


def ui_run_url(ui: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI served at `ui`, in the model-training view (`MODEL_TRAINING_VIEW`): the
    page lists the run's metrics, not an empty GenAI overview."""
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def run_url(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI of an `http(s)://` tracking server (None for a local store)."""
    return ui_run_url(uri, experiment_id, run_id) if _is_server(uri) else None


def flow_run_note(flow_run_url: str | None, flow_run_name: str | None, flow_run_id: str | None) -> str | None:
    """The description (`NOTE_TAG`, markdown) of an MLflow run that a Prefect flow run drives: a link to the flow
    run's page where its address is known, else its name and id (a flow run on a temporary server has no page to
    link). None without a flow run."""
    if not flow_run_id:
        return None
    name = (flow_run_name or flow_run_id).replace("[", "(").replace("]", ")")
    if flow_run_url:
        return f"Driven by the Prefect flow run [{name}]({flow_run_url}): its log, tasks and artifacts."
    return f"Driven by the Prefect flow run `{name}` (id `{flow_run_id}`)."


def _mark_model_training(client: MlflowClient, experiment: Any) -> None:
    """Tag an experiment (mlflow.entities.Experiment) as model training (`EXPERIMENT_KIND`) unless a person chose
    its kind (`CHOSEN_KINDS`); an untagged one, or one whose kind MLflow only inferred, gets the tag."""
    if experiment.tags.get(EXPERIMENT_KIND_TAG) not in CHOSEN_KINDS:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


class MlflowSink(_EventsMixin):
    """`MetricsSink` over an MLflow tracking store (sqlite:///... needs no server). Thread-safe."""

    def __init__(self, uri: str, experiment: str, artifacts: str | None = None, flush_every_s: float = 30.0):
        self.uri, self.experiment_name, self.flush_every_s = uri, experiment, flush_every_s
        self._client: MlflowClient = _import_mlflow_client()(tracking_uri=uri)
        self._lock = threading.RLock()
        self._stack: list[_RunState] = []
        exp = self._client.get_experiment_by_name(experiment)
        if exp is None:
            self.experiment_id = self._client.create_experiment(
                experiment, artifact_location=artifact_location(uri, artifacts),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        else:
            self.experiment_id = exp.experiment_id
            _mark_model_training(self._client, exp)
        self.artifact_root = self._client.get_experiment(self.experiment_id).artifact_location

    @classmethod
    def from_config(cls, tracking: Any, flush_every_s: float = 30.0) -> MlflowSink:
        """Build from a `TrackingConfig` (`mlflow_uri`, `mlflow_artifacts`, `experiment`)."""
        return cls(tracking.mlflow_uri, tracking.experiment, tracking.mlflow_artifacts, flush_every_s)

    @property
    def client(self) -> MlflowClient:
        return self._client

    def run_url(self, run_id: str) -> str | None:
        return run_url(self.uri, self.experiment_id, run_id)

    def end_lost_run(self, run_id: str) -> bool:
        """End another driver's run that died without a word (`KILLED`, as MLflow names a run whose process was
        killed) if this store holds it and it is still RUNNING; False when it does not or it had ended."""
        from mlflow.exceptions import MlflowException
        try:
            with self._lock:
                if self._client.get_run(run_id).info.status != "RUNNING":
                    return False
                self._client.set_terminated(run_id, "KILLED")
        except MlflowException:   # held by another tracking store than this run's
            return False
        return True

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

    def resume_run(self, run_id: str) -> bool:
        """Reopen an ended run of this experiment as the innermost run (RUNNING again; `end_run` ends it anew):
        a sweep continued later keeps its trials under one parent. False where the store has no such run."""
        from mlflow.exceptions import MlflowException
        with self._lock:
            try:
                run = self._client.get_run(run_id)
            except MlflowException:
                return False
            if run.info.experiment_id != self.experiment_id or run.info.lifecycle_stage != "active":
                return False
            self._client.update_run(run_id, status="RUNNING")
            self._stack.append(_RunState(run_id))
        return True

    def _write_metrics(self, run_id: str, metrics: Mapping[str, float], step: int,
                       timestamp: float | None = None) -> None:
        from mlflow.entities import Metric
        ms = int((time.time() if timestamp is None else timestamp) * 1000)
        items = [Metric(sanitize_key(k), v, ms, int(step)) for k, v in metrics.items()]
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self._client.log_batch(run_id, metrics=items[i:i + MAX_METRICS_PER_BATCH])

    def log_metrics(self, metrics: Mapping[str, object], step: int, timestamp: float | None = None) -> None:
        """`metrics` at `step`, stamped `timestamp` (unix seconds; default now): MLflow's "Time" axis."""
        values = {k: _metric_value(k, v) for k, v in metrics.items()}
        with self._lock:
            self._write_metrics(self._top().run_id, values, step, timestamp)

    def log_event(self, kind: str, record: Mapping[str, object]) -> None:
        with self._lock:
            top = self._top()
            self._add_event(top, sanitize_key(kind), record)
            if time.monotonic() - top.last_flush >= self.flush_every_s:
                self._flush(top)

    def _flush(self, state: _RunState) -> None:
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS
        self._client.log_text(state.run_id, events_table(state.events, state.started), EVENTS_TABLE)
        if not state.tagged:   # the tag that makes MLflow list the file as a table (what `log_table` sets)
            tables = json.loads(self._client.get_run(state.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
            entry = {"path": EVENTS_TABLE, "type": "table"}
            if entry not in tables:
                self._client.set_tag(state.run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*tables, entry]))
            state.tagged = True
        state.last_flush, state.dirty = time.monotonic(), False

    def flush(self) -> None:
        """Write the current run's events table now."""
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


# ---- reading runs back (tidal compare) -------------------------------------------------------------------------

def store_client(uri: str) -> MlflowClient:
    """An MlflowClient on an existing tracking store (a SQLite path that holds no store is an error)."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_file():
            raise TidalError("--uri", uri, "no MLflow store at this path",
                             "pass --uri sqlite:///path/to/mlruns.db (tracking.mlflow_uri of the runs)")
    return _import_mlflow_client()(tracking_uri=uri)


def find_run(client: MlflowClient, run_id: str) -> Any | None:
    """The run `run_id` of the client's store (mlflow.entities.Run), None where there is none."""
    from mlflow.exceptions import MlflowException
    try:
        return client.get_run(run_id)
    except MlflowException:
        return None
