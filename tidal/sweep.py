"""`tidal sweep SPACE --trials N [--real] [--json PATH]`: Optuna sweeps of the scheduler's settings.

A sweep space is a YAML file (`experiments/sweep_*.yaml`) with a top-level `space:` of config keys::

    study: policy-flags                       # Optuna study name (+ "-sim" / "-real": values differ in kind)
    objectives: [step_time, reshards]         # one or more of OBJECTIVES; multi-objective -> a Pareto front
    simulator: {workload: rlinf-example, devices: 8, steps: 4, seed: 0}   # or workload: a config path
    real: {config: experiments/rlinf_dynamic.yaml, overrides: [run.num_steps=2]}   # for --real
    space:
      scheduler.policy: {choices: [rlinf, tidal]}
      cluster.use_pre_process_policy: {type: bool}
      scheduler.pre_process_threshold: {low: 0.1, high: 0.9,
                                        when: {scheduler.policy: rlinf, cluster.use_pre_process_policy: true}}

Each `space` entry is a config key (dotted, as in overrides) and how to draw it: `{type: bool}`,
`{choices: [...]}`, `{low, high}` (float; `type: int` for integers; `log: true`). `when` makes a key
conditional on keys drawn before it (a threshold only matters for the policy that reads it).

One trial::

    ask      -> params (TPE, seeded), never the settings of an earlier trial of the study (a repeat is told
                PRUNED with `duplicate_of` and drawn again)      Optuna study in the platform database
                (RDB storage), its metrics named with their units (`METRIC_NAMES`: step_time_s, reshards, ...)
    evaluate -> simulator: simulate(spec with params, policy, devices, steps, seed)   (milliseconds)
                real:      a whole training run (run_training), database rows and all   (a minute or more)
    record   -> MLflow run nested under the study's run (one per study: a later invocation continues it;
                study user attributes `mlflow_parent_run_id` and, with a tracking server, `mlflow_parent_run_url`;
                the trial's run: params, objective values `sweep/<metric name>`,
                tags `tidal.sweep` = study, `tidal.trial` = number, `tidal.policy`); its id is the trial's user
                attribute `mlflow_run_id`, with a tracking server its page `mlflow_run_url` (real runs: the
                training run itself, with `db_run_id` too)
    tell     -> objective values (or FAIL with the error, for a combination the config refuses)

Storage: `--storage URL`, else `$TIDAL_OPTUNA_STORAGE`, else `tracking.db_url` (Optuna creates its own
tables beside ours; our migrations only look at ours). The report lists the complete trials, the best
settings and the Pareto front. With several objectives "best" is the Pareto trial that is best on the first
objective (ties: the next ones), so put the objective you care most about first.

The summary (`summary_markdown(report)`: `tidal sweep` prints it, the `policy-sweep` flow run shows it as its
markdown artifact) holds the best settings as a config snippet to paste, the Pareto front, every trial with its
values (front marked), and the ways to the study and the MLflow parent run: the study's page in optuna-dashboard
(`$TIDAL_OPTUNA_DASHBOARD_URL`, else the dashboard `tidal up` started over this storage), else the storage and the
command that serves it; the parent run's page (a tracking server), else its id and the `mlflow ui` command.

The loop is written once (`sweep_loop`: ask, evaluate, `trials` times; report; close with the sweep's status) over
a handful of verbs (`SweepVerbs`): `tidal sweep` (`run_sweep`) drives it over a `Sweep`, the `policy-sweep` flow
over its tasks (`tasks.sweep.SweepTasks`), each verb a task run.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast, overload

import yaml
from rich.console import Console
from rich.markdown import Markdown

from scheduler.simulator import simulate
from scheduler.workload import rlinf_example
from tidal.core.bounded_yaml import load_yaml, read_text
from tidal.core.config import TidalConfig, build_config, flatten, sweep_storage
from tidal.core.errors import TidalError
from tidal.core.secrets import redact
from tidal.pipeline.tracked_run import (
    RunTracking,
    closed_with_status,
    env_overrides,
    load_run_config,
    policy_name,
    run_dir,
)
from tidal.tracking import MlflowSink, run_url

#: objective -> direction (real runs only: accuracy)
Direction = Literal["minimize", "maximize"]
OBJECTIVES: dict[str, Direction] = {"step_time": "minimize", "reshards": "minimize", "migrations": "minimize",
                                    "idle": "minimize", "accuracy": "maximize"}
#: objective -> the study's metric name, unit included (what optuna-dashboard shows on its axes)
METRIC_NAMES = {"step_time": "step_time_s", "reshards": "reshards", "migrations": "migrations",
                "idle": "idle_fraction", "accuracy": "heldout_accuracy"}
REAL_ONLY = ("accuracy",)
#: draws of the sampler a trial may take to find settings no earlier trial of the study had
MAX_REDRAWS = 200
POLICY_KEY = "scheduler.policy"
#: config keys the built-in `rlinf-example` workload understands -> its PolicyParams field
SIM_KEYS = {"cluster.use_pre_process_policy": "use_pre_process_policy",
            "cluster.use_wait_before_last_iter_policy": "use_wait_before_last_iter_policy",
            "scheduler.pre_process_threshold": "pre_process_threshold",
            "rollout.max_running_requests": "max_running_requests",
            "scheduler.lend_actor": "lend_actor", "scheduler.grow_on_return": "grow_on_return",
            "scheduler.return_on_generated": "return_on_generated", "scheduler.margin_frac": "margin_frac"}
BUILTIN = "rlinf-example"
#: an optuna-dashboard serving the sweeps' storage (compose, a team's server), e.g. http://127.0.0.1:8080
DASHBOARD_ENV = "TIDAL_OPTUNA_DASHBOARD_URL"
STORAGE_ENV = "TIDAL_OPTUNA_STORAGE"
#: where `tidal up` serves optuna-dashboard and the MLflow UI by default (`tidal.cli.services.DEFAULT_PORTS`)
LOCAL_DASHBOARD, LOCAL_MLFLOW_UI = "http://127.0.0.1:8080", "http://127.0.0.1:5000"
#: trials the summary's table lists (the latest); the study holds them all
MAX_SUMMARY_TRIALS = 200

log = logging.getLogger("tidal.sweep")
ReportT = TypeVar("ReportT", covariant=True)


# ---- the space ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Param:
    """One swept config key and how to draw it."""

    key: str
    kind: Literal["bool", "choice", "float", "int"]
    choices: tuple[Any, ...] = ()
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    when: tuple[tuple[str, Any], ...] = ()   #: drawn only if these keys were drawn with these values

    def active(self, drawn: dict[str, Any]) -> bool:
        return all(k in drawn and drawn[k] == v for k, v in self.when)

    def suggest(self, trial: Any) -> Any:
        if self.kind == "bool":
            return trial.suggest_categorical(self.key, [False, True])
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, log=self.log)


@dataclass(frozen=True)
class SweepSpace:
    path: str
    study: str
    params: tuple[Param, ...]
    objectives: tuple[str, ...]
    workload: str = BUILTIN                  #: simulator: `rlinf-example` or a config path
    devices: int | None = None               #: simulator: scale the placement to N devices
    steps: int = 4                           #: simulator: RL steps per trial
    seed: int = 0                            #: simulator workload seed; also the sampler's seed
    sim_overrides: tuple[str, ...] = ()      #: simulator: overrides of a config workload
    config: str | None = None                #: real runs' config (and the sweep's tracking settings)
    overrides: tuple[str, ...] = ()          #: real runs' overrides

    @property
    def directions(self) -> list[Direction]:
        return [OBJECTIVES[o] for o in self.objectives]


def _err(path: str, where: str, value: object, problem: str, fix: str) -> TidalError:
    return TidalError(f"{path}: {where}", value, problem, fix)


def _mapping(path: str, where: str, value: object) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _err(path, where, value, "must be a mapping", f"write `{where}:` as `key: value` lines")
    return value


def _param(path: str, key: str, spec: object, earlier: dict[str, Param]) -> Param:
    where = f"space.{key}"
    spec = _mapping(path, where, spec)
    unknown = set(spec) - {"type", "choices", "low", "high", "log", "when"}
    if unknown:
        raise _err(path, where, sorted(unknown)[0], "unknown setting",
                   "use type (bool|int|float|choice), choices, low, high, log, when")
    when = []
    for k, v in _mapping(path, f"{where}.when", spec.get("when")).items():
        if k not in earlier:
            raise _err(path, f"{where}.when", k, "names no key drawn before this one",
                       f"list {k} above {key} in `space:` (conditions look at earlier keys)")
        when.append((k, v))
    kind: Any = spec.get("type") or ("choice" if "choices" in spec else "float")
    if kind == "bool":
        return Param(key, "bool", when=tuple(when))
    if kind == "choice":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise _err(path, f"{where}.choices", choices, "must be a non-empty list", "e.g. choices: [rlinf, tidal]")
        return Param(key, "choice", tuple(choices), when=tuple(when))
    if kind not in ("int", "float"):
        raise _err(path, f"{where}.type", kind, "unknown type", "use bool, int, float or choice")
    lo: Any = spec.get("low")
    hi: Any = spec.get("high")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (lo, hi)) or not lo <= hi:
        raise _err(path, where, f"low={lo}, high={hi}", "needs numbers low <= high", "e.g. {low: 0.1, high: 0.9}")
    if spec.get("log") and lo <= 0:
        raise _err(path, f"{where}.low", lo, "a log scale needs low > 0", "raise low or drop log: true")
    return Param(key, kind, low=float(lo), high=float(hi), log=bool(spec.get("log")), when=tuple(when))


@overload
def _resolve(path: str, space_path: Path) -> str: ...


@overload
def _resolve(path: None, space_path: Path) -> None: ...


def _resolve(path: str | None, space_path: Path) -> str | None:
    """Config paths: from the current directory, else from the space file's folder or its parent."""
    if path is None or path == BUILTIN or Path(path).is_absolute() or Path(path).exists():
        return path
    for base in (space_path.parent, space_path.parent.parent):
        if (base / path).exists():
            return str(base / path)
    return path


def load_space(path: str | Path) -> SweepSpace:
    """Read and check a sweep space file (`bounded_yaml.load_yaml`); errors name the key and the fix."""
    p = Path(path)
    if not p.is_file():
        raise TidalError("SPACE", str(path), "file not found", "pass a sweep space like experiments/sweep_policy.yaml")
    try:
        data = load_yaml(read_text(p, "SPACE"), "SPACE")
    except yaml.YAMLError:
        raise TidalError("SPACE", str(path), "is not valid YAML", "fix the file's syntax") from None
    sp = str(path)
    data = _mapping(sp, "<top level>", data)
    unknown = set(data) - {"study", "objectives", "simulator", "real", "space", "description"}
    if unknown:
        raise _err(sp, sorted(unknown)[0], sorted(unknown)[0], "unknown top-level key",
                   "use study, objectives, simulator, real, space, description")
    raw = data.get("space")
    if not isinstance(raw, dict) or not raw:
        raise _err(sp, "space", raw, "a sweep needs a non-empty top-level `space:` mapping",
                   "add `space:` with config keys, e.g. `scheduler.policy: {choices: [rlinf, tidal]}`")
    params: dict[str, Param] = {}
    for key, spec in raw.items():
        params[str(key)] = _param(sp, str(key), spec, params)
    objs = data.get("objectives", ["step_time"])
    objs = list(objs) if isinstance(objs, list) else [objs]
    for o in objs:
        if o not in OBJECTIVES:
            raise _err(sp, "objectives", o, "unknown objective", f"use some of {', '.join(OBJECTIVES)}")
    if len(set(objs)) != len(objs) or not objs:
        raise _err(sp, "objectives", objs, "must list distinct objectives", "e.g. [step_time, reshards]")
    sim = _mapping(sp, "simulator", data.get("simulator"))
    real = _mapping(sp, "real", data.get("real"))
    for where, m, keys in (("simulator", sim, {"workload", "devices", "steps", "seed", "overrides"}),
                           ("real", real, {"config", "overrides"})):
        if set(m) - keys:
            raise _err(sp, where, sorted(set(m) - keys)[0], "unknown key", f"use {', '.join(sorted(keys))}")
    space = SweepSpace(sp, str(data.get("study") or p.stem), tuple(params.values()), tuple(objs),
                       workload=_resolve(str(sim.get("workload", BUILTIN)), p), devices=sim.get("devices"),
                       steps=int(sim.get("steps", 4)), seed=int(sim.get("seed", 0)),
                       sim_overrides=tuple(sim.get("overrides") or ()), config=_resolve(real.get("config"), p),
                       overrides=tuple(real.get("overrides") or ()))
    if space.steps < 1:
        raise _err(sp, "simulator.steps", space.steps, "must be at least 1", "e.g. steps: 4")
    return space


def check_space(space: SweepSpace, real: bool) -> None:
    """Every swept key must mean something to the chosen backend."""
    if real:
        if not space.config:
            raise _err(space.path, "real.config", None, "--real needs the config of the runs",
                       "add `real: {config: experiments/rlinf_dynamic.yaml}`")
        known, what = set(flatten(TidalConfig())), "a config key"
    elif space.workload == BUILTIN:
        known, what = set(SIM_KEYS) | {POLICY_KEY}, f"a key the built-in {BUILTIN} workload reads"
    else:
        known, what = set(flatten(TidalConfig())), "a config key"
    for prm in space.params:
        if prm.key not in known:
            near = difflib.get_close_matches(prm.key, sorted(known), n=1)
            raise _err(space.path, f"space.{prm.key}", prm.key, f"is not {what}",
                       f"did you mean {near[0]}?" if near else f"use one of {', '.join(sorted(known)[:8])} ...")
    if not real:
        bad = [o for o in space.objectives if o in REAL_ONLY]
        if bad:
            raise _err(space.path, "objectives", bad[0], "is measured only on real runs", "add --real or drop it")


def draw(space: SweepSpace, trial: Any) -> dict[str, Any]:
    """The trial's settings: every active key of the space, in order."""
    drawn: dict[str, Any] = {}
    for prm in space.params:
        if prm.active(drawn):
            drawn[prm.key] = prm.suggest(trial)
    return drawn


def _settings_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def as_overrides(params: dict[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v)}" for k, v in params.items()]


# ---- evaluating one trial -----------------------------------------------------------------------------------

def simulate_trial(space: SweepSpace, params: dict[str, Any]) -> dict[str, float]:
    """The settings on the simulator (the same policy code as real runs)."""
    if space.workload == BUILTIN:
        spec = rlinf_example(space.devices or 8)
        spec = replace(spec, params=replace(spec.params, **{SIM_KEYS[k]: v for k, v in params.items()
                                                            if k in SIM_KEYS}))
        res = simulate(spec, params.get(POLICY_KEY, "tidal"), None, space.steps, space.seed, keep_events=False)
    else:
        cfg = load_run_config(space.workload, [*space.sim_overrides, *as_overrides(params)])
        res = simulate(cfg, None, space.devices, space.steps, space.seed, keep_events=False)
    return {"step_time": res.mean_step_s, "reshards": float(sum(s.reshards for s in res.steps)),
            "migrations": float(sum(s.migrations for s in res.steps)), "idle": res.idle_fraction}


def sim_policy(space: SweepSpace, params: dict[str, Any]) -> str:
    """The scheduler policy a simulated trial runs (its `tidal.policy` tag)."""
    if space.workload == BUILTIN:
        return str(params.get(POLICY_KEY, "tidal"))
    return policy_name(load_run_config(space.workload, [*space.sim_overrides, *as_overrides(params)]))


def real_trial(space: SweepSpace, params: dict[str, Any], overrides: list[str], name: str, sink: Any,
               parent_run_id: str, tags: dict[str, str]) -> tuple[dict[str, float], str | None, int | None]:
    """A whole training run with the settings, tracked as a child of the sweep's MLflow run.
    Returns (objective values, MLflow run id, database run id)."""
    from tidal.pipeline.preflight import preflight
    from tidal.pipeline.run import run_training
    config = cast(str, space.config)  # check_space requires one of real runs
    cfg = load_run_config(config, [*space.overrides, *overrides, *as_overrides(params), f"run.name={name}"])
    checked = preflight(cfg, tracked=True)   # before the trial's folder and records exist
    out = run_dir(cfg)
    tracking = RunTracking.open(cfg, out, sink=sink, parent_run_id=parent_run_id, tags=tags)
    status = "FAILED"
    try:
        s = run_training(cfg, out, tracking.sink, tracking.recorder, checked=checked)
        status = "FINISHED"
    finally:
        tracking.close(status, [out / n for n in ("timeline.png", "summary.json", "events.json")])
    values = {"step_time": sum(s.step_seconds) / max(1, len(s.step_seconds)), "reshards": float(s.reshards),
              "migrations": float(s.migrations), "idle": s.device_idle_fraction, "accuracy": s.eval_accuracy_end}
    return values, tracking.mlflow_run_id, tracking.db_run_id


# ---- the study ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrialSpec:
    number: int
    params: dict[str, Any]


@dataclass(frozen=True)
class TrialResult:
    number: int
    params: dict[str, Any]
    state: str                         #: COMPLETE or FAIL
    values: dict[str, float] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class SweepReport:
    study: str
    storage: str
    objectives: list[str]
    directions: list[Direction]
    n_trials: int                      #: complete trials in the study (all invocations)
    n_failed: int
    best_trial: int
    best_params: dict[str, Any]
    best_values: dict[str, float]
    best_mlflow_run_id: str | None
    pareto: list[dict[str, Any]]       #: [{number, params, values, mlflow_run_id}], best first
    mlflow_parent_run_id: str | None
    #: every complete or failed trial of the study, by number: {number, state, params, metrics, mlflow_run_id,
    #: error}; metrics are all the trial measured (the objectives and the others), by objective name
    trials: list[dict[str, Any]] = field(default_factory=list)
    study_id: int | None = None        #: the study's id in its storage (optuna-dashboard's page of it)
    dashboard_url: str | None = None   #: the study's page in an optuna-dashboard serving its storage
    mlflow_uri: str | None = None      #: the tracking store, credentials masked
    mlflow_experiment_id: str | None = None
    mlflow_parent_run_url: str | None = None   #: the parent run's page (a tracking server only)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def storage_url(cfg: TidalConfig, storage: str | None) -> str:
    return sweep_storage(cfg.tracking.db_url, storage)


def _masked(url: str) -> str:
    from sqlalchemy.engine import make_url
    return make_url(url).render_as_string(hide_password=True)


def dashboard_url(storage: str, study_id: int) -> str | None:
    """The study's page in the optuna-dashboard at $TIDAL_OPTUNA_DASHBOARD_URL (`tidal up`'s env file sets it beside
    $TIDAL_OPTUNA_STORAGE, the storage that dashboard serves), else None. A dashboard over another storage is never
    linked: its study ids name other studies."""
    base = os.environ.get(DASHBOARD_ENV)
    served = os.environ.get(STORAGE_ENV)
    if not base or (served and served != storage):
        return None
    return f"{base.rstrip('/')}/dashboard/studies/{study_id}"


class Sweep:
    """An open sweep: its Optuna study (RDB storage) and its MLflow parent run. `ask`, `evaluate`, `report`."""

    def __init__(self, space: SweepSpace, *, real: bool = False, overrides: list[str] | tuple[str, ...] = (),
                 storage: str | None = None, study: str | None = None):
        import optuna

        check_space(space, real)
        self.space, self.real, self.overrides = space, real, list(overrides)
        self.cfg = load_run_config(space.config, self.overrides) if space.config \
            else build_config({}, env_overrides() + self.overrides)
        self.storage = storage_url(self.cfg, storage)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study_name = study or f"{space.study}-{'real' if real else 'sim'}"
        rdb = optuna.storages.RDBStorage(self.storage, engine_kwargs=_engine_kwargs(self.storage))
        self._rdb = rdb
        try:
            existing = optuna.load_study(study_name=self.study_name, storage=rdb)
        except KeyError:
            existing = None
        if existing is not None:
            have = [d.name.lower() for d in existing.directions]
            if have != space.directions:
                raise TidalError("--study", self.study_name,
                                 f"exists in {_masked(self.storage)} with directions {have}, the space asks "
                                 f"{space.directions} ({list(space.objectives)})",
                                 "pass --study with a new name, or keep the study's objectives")
        done = len(existing.trials) if existing is not None else 0
        # Seed offset by the trials already there: a resumed study does not redraw the same random points.
        sampler = optuna.samplers.TPESampler(seed=space.seed + done)
        self.study = optuna.create_study(study_name=self.study_name, storage=rdb, directions=space.directions,
                                         sampler=sampler, load_if_exists=True)
        with warnings.catch_warnings():   # stable since Optuna 3.2, still flagged experimental
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self.study.set_metric_names([METRIC_NAMES[o] for o in space.objectives])
        self.study.set_user_attr("objectives", list(space.objectives))
        self.study.set_user_attr("space", space.path)
        self._trials: dict[int, Any] = {}
        self.sink = MlflowSink.from_config(self.cfg.tracking)
        # one parent run per study, continued by later invocations: every trial is its MLflow child (the tag
        # `tidal.sweep` is on the trials only, so `tidal compare --sweep` compares trials)
        parent = self.study.user_attrs.get("mlflow_parent_run_id")
        if not (parent and self.sink.resume_run(parent)):
            parent = self.sink.start_run(
                f"sweep-{self.study_name}",
                {"sweep.space": space.path, "sweep.real": real, "sweep.objectives": list(space.objectives),
                 **{f"space.{p.key}": _describe(p) for p in space.params}},
                {"optuna.study": self.study_name, "optuna.storage": _masked(self.storage)})
            self.study.set_user_attr("mlflow_parent_run_id", parent)
            url = self.sink.run_url(parent)
            if url:
                self.study.set_user_attr("mlflow_parent_run_url", url)
        self.parent_run_id: str = parent

    def ask(self) -> TrialSpec:
        """The next trial, with settings no earlier trial of the study had: a draw that repeats one is told
        PRUNED (user attribute `duplicate_of`) and the sampler draws again."""
        import optuna
        seen = {_settings_key(t.params): t.number for t in self.study.get_trials(deepcopy=False)
                if t.state != optuna.trial.TrialState.PRUNED}
        for _ in range(MAX_REDRAWS):
            trial = self.study.ask()
            params = draw(self.space, trial)
            earlier = seen.get(_settings_key(params))
            if earlier is None:
                self._trials[trial.number] = trial
                return TrialSpec(trial.number, params)
            trial.set_user_attr("duplicate_of", earlier)
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        raise TidalError("--trials", len(seen), f"leaves no untried settings in {self.space.path} "
                         f"({MAX_REDRAWS} draws repeated earlier trials)",
                         "ask fewer trials, widen the space, or start a new study with --study")

    def evaluate(self, spec: TrialSpec) -> TrialResult:
        """Run the trial, record it in MLflow, tell Optuna. A config the trial's settings make invalid fails the
        trial (state FAIL, the error kept); any other error fails it and propagates."""
        import optuna
        trial = self._trials.pop(spec.number)
        name = f"{self.study_name}-trial-{spec.number}"
        tags = {"tidal.sweep": self.study_name, "tidal.trial": str(spec.number)}
        try:
            if self.real:
                values, run_id, db_id = real_trial(self.space, spec.params, self.overrides, name, self.sink,
                                                   self.parent_run_id, tags)
                trial.set_user_attr("db_run_id", db_id)
            else:
                tags["tidal.policy"] = sim_policy(self.space, spec.params)
                run_id = self.sink.start_run(name, spec.params, tags, parent_run_id=self.parent_run_id)
                try:
                    values = simulate_trial(self.space, spec.params)
                    self.sink.log_metrics({f"sweep/{METRIC_NAMES[k]}": v for k, v in values.items()}, 0)
                    self.sink.end_run("FINISHED")
                except BaseException:
                    self.sink.end_run("FAILED")
                    raise
        except TidalError as e:
            trial.set_user_attr("error", str(e))
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.warning("trial %d failed: %s", spec.number, e)
            return TrialResult(spec.number, spec.params, "FAIL", error=str(e))
        except BaseException as e:
            trial.set_user_attr("error", f"{type(e).__name__}: {e}")
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        trial.set_user_attr("mlflow_run_id", run_id)
        url = self.sink.run_url(run_id) if run_id else None
        if url:
            trial.set_user_attr("mlflow_run_url", url)
        trial.set_user_attr("metrics", values)
        self.study.tell(trial, [values[o] for o in self.space.objectives])
        return TrialResult(spec.number, spec.params, "COMPLETE", values, run_id)

    def report(self) -> SweepReport:
        import optuna
        trials = self.study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        failed = sum(t.state == optuna.trial.TrialState.FAIL for t in trials)
        if not complete:
            errors = {t.user_attrs["error"] for t in trials if t.user_attrs.get("error")}
            raise TidalError("SPACE", self.space.path, f"no trial of study {self.study_name!r} completed "
                             f"(errors: {sorted(errors)[:3]})", "fix the space so its settings make valid configs")
        sign = [1.0 if d == "minimize" else -1.0 for d in self.space.directions]
        front = sorted(self.study.best_trials, key=lambda t: tuple(s * v for s, v in zip(sign, t.values)))
        objs = list(self.space.objectives)
        pareto: list[dict[str, Any]] = [{"number": t.number, "params": t.params, "values": dict(zip(objs, t.values)),
                   "mlflow_run_id": t.user_attrs.get("mlflow_run_id")} for t in front]
        best = pareto[0]
        values = dict(best["values"])
        self.sink.log_metrics({f"best/{METRIC_NAMES[k]}": v for k, v in values.items()}
                              | {"sweep/trial_count": len(complete)}, len(complete))
        study_id = self._rdb.get_study_id_from_name(self.study_name)
        return SweepReport(self.study_name, _masked(self.storage), objs, self.space.directions, len(complete),
                           failed, best["number"], best["params"], values, best["mlflow_run_id"], pareto,
                           self.parent_run_id, trials=[_trial_row(t) for t in trials if t.state in (
                               optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)],
                           study_id=study_id, dashboard_url=dashboard_url(self.storage, study_id),
                           mlflow_uri=redact(self.sink.uri), mlflow_experiment_id=self.sink.experiment_id,
                           mlflow_parent_run_url=run_url(self.sink.uri, self.sink.experiment_id, self.parent_run_id))

    def close(self, status: str = "FINISHED") -> None:
        """End the sweep's MLflow run (KILLED also ends a trial's run left open)."""
        if status == "KILLED":
            self.sink.close()
        else:
            self.sink.end_run(status)


def _trial_row(t: Any) -> dict[str, Any]:
    """A finished trial as the report lists it: what it measured is its `metrics` user attribute (every value the
    backend returns), else its objective values."""
    return {"number": t.number, "state": t.state.name, "params": dict(t.params),
            "metrics": dict(t.user_attrs.get("metrics") or {}), "mlflow_run_id": t.user_attrs.get("mlflow_run_id"),
            "error": t.user_attrs.get("error")}


def _engine_kwargs(url: str) -> dict[str, Any]:
    # The platform database is shared with running training runs: wait for SQLite's write lock, don't fail.
    return {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}


def _describe(p: Param) -> str:
    what = {"bool": "bool", "choice": f"choices {list(p.choices)}",
            "float": f"[{p.low:g}, {p.high:g}]{' log' if p.log else ''}",
            "int": f"int [{int(p.low)}, {int(p.high)}]"}[p.kind]
    return what + (f" when {dict(p.when)}" if p.when else "")


class SweepVerbs(Protocol[ReportT]):
    """What `sweep_loop` asks of an open sweep: `Sweep` itself (`tidal sweep`), or the `policy-sweep` flow's tasks
    (`tasks.sweep.SweepTasks`). `close` ends the sweep with a status (FINISHED, FAILED, KILLED) whatever happened."""

    def ask(self) -> TrialSpec: ...

    def evaluate(self, spec: TrialSpec) -> TrialResult: ...

    def report(self) -> ReportT: ...

    def close(self, status: str) -> None: ...


def sweep_loop(verbs: SweepVerbs[ReportT], trials: int,
               on_trial: Callable[[TrialResult], None] | None = None) -> ReportT:
    """The sweep, written once: `trials` times ask the sampler and evaluate its settings (each `ask` sees every
    earlier result), then the report; the sweep is closed in every case, FINISHED or `closing_status` of what
    ended it. `on_trial(result)` after each trial."""
    with closed_with_status(verbs.close):
        for _ in range(trials):
            result = verbs.evaluate(verbs.ask())
            if on_trial:
                on_trial(result)
        return verbs.report()


def run_sweep(space: SweepSpace, trials: int, *, real: bool = False, overrides: list[str] | tuple[str, ...] = (),
              storage: str | None = None, study: str | None = None,
              on_trial: Callable[[TrialResult], None] | None = None) -> SweepReport:
    """Add `trials` trials to the study and report (`sweep_loop` over the `Sweep`); `on_trial(TrialResult)` after
    each."""
    if trials < 1:
        raise TidalError("--trials", trials, "must be at least 1", "e.g. --trials 16")
    return sweep_loop(Sweep(space, real=real, overrides=overrides, storage=storage, study=study), trials, on_trial)


# ---- CLI ----------------------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)


def _cell(v: Any) -> str:
    return _fmt(v).replace("|", "\\|").replace("\n", " ")


def _settings(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in params.items()) or "-"


def config_snippet(params: dict[str, Any]) -> str:
    """Settings as the YAML a config holds (`scheduler.policy: rlinf` -> `scheduler:\n  policy: rlinf`), values
    exact (not rounded): pasted into an experiment config it sets what the trial ran."""
    nested: dict[str, Any] = {}
    for key, value in params.items():
        *sections, leaf = key.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return yaml.safe_dump(nested, sort_keys=False, default_flow_style=False).rstrip()


def _metric_keys(report: SweepReport) -> list[str]:
    """The objectives, then whatever else the trials measured, in OBJECTIVES' order."""
    measured = {k for t in report.trials for k in t["metrics"]}
    return [*report.objectives, *(k for k in OBJECTIVES if k in measured and k not in report.objectives)]


def _header(report: SweepReport, keys: list[str]) -> list[str]:
    arrow = {"minimize": " ↓", "maximize": " ↑"}
    goal = dict(zip(report.objectives, report.directions))
    return [f"{METRIC_NAMES[k]}{arrow[goal[k]] if k in goal else ''}" for k in keys]


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)]


def _links(report: SweepReport) -> list[str]:
    """The study in optuna-dashboard and the sweep's MLflow parent run: a page where one is known, else how to
    serve the store and the address the page then has."""
    if report.dashboard_url:
        study = f"- Optuna study `{report.study}`: [optuna-dashboard]({report.dashboard_url})"
    else:
        page = f"{LOCAL_DASHBOARD}/dashboard/studies/{report.study_id}" if report.study_id is not None else \
            f"{LOCAL_DASHBOARD}/dashboard"
        study = (f"- Optuna study `{report.study}` in storage `{report.storage}`: serve it with "
                 f"`optuna-dashboard {report.storage}` (or `tidal up`, over $TIDAL_OPTUNA_STORAGE / the platform "
                 f"database) and open [{page}]({page})")
    run = report.mlflow_parent_run_id
    if report.mlflow_parent_run_url:
        mlflow = f"- MLflow parent run: [{run}]({report.mlflow_parent_run_url}) (each trial is a child run)"
    elif run and report.mlflow_uri and report.mlflow_experiment_id is not None:
        local = run_url(LOCAL_MLFLOW_UI, report.mlflow_experiment_id, run)   # an http:// address: never None
        mlflow = (f"- MLflow parent run `{run}` (each trial is a child run) in the local store "
                  f"`{report.mlflow_uri}`: serve it with `mlflow ui --backend-store-uri {report.mlflow_uri} "
                  f"--host 127.0.0.1` (or `tidal up`) and open [{local}]({local})")
    else:
        mlflow = f"- MLflow parent run `{run}`"
    return [study, mlflow]


def summary_markdown(report: SweepReport) -> str:
    """The sweep's summary: best settings as a config snippet and as overrides, the Pareto front (best first),
    every trial (the latest MAX_SUMMARY_TRIALS) with the front marked, and the links (`_links`). Pure: the same
    text is the flow run's artifact and what `tidal sweep` prints."""
    keys = _metric_keys(report)
    front = {row["number"] for row in report.pareto}
    several = len(report.objectives) > 1
    goals = ", ".join(f"{METRIC_NAMES[o]} ({d})" for o, d in zip(report.objectives, report.directions))
    best_values = ", ".join(f"{METRIC_NAMES[k]} {_fmt(v)}" for k, v in report.best_values.items())
    lines = [f"# Sweep `{report.study}`", "",
             f"{report.n_trials} complete trials, {report.n_failed} failed. Objectives: {goals}.", "",
             f"## Best settings: trial {report.best_trial}", "",
             f"{best_values}" + (f" (the Pareto front's best on {METRIC_NAMES[report.objectives[0]]}, the first "
                                 "objective)" if several else "") + ". In an experiment config:", "",
             "```yaml", config_snippet(report.best_params), "```", "",
             "or as overrides (`tidal train -o`, the rl-training form's `overrides`): "
             + " ".join(f"`{o}`" for o in as_overrides(report.best_params)), ""]
    title = "## Pareto front" if several else "## Best trial"
    lines += [title, "", "Best first; no other trial is at least as good on every objective and better on one."
              if several else "The single objective's best.", ""]
    lines += _table(["trial", *_header(report, list(report.objectives)), "settings"],
                    [[row["number"], *(row["values"][o] for o in report.objectives), _settings(row["params"])]
                     for row in report.pareto])
    shown = report.trials[-MAX_SUMMARY_TRIALS:]
    more = f" (the latest {len(shown)} of {len(report.trials)})" if len(shown) < len(report.trials) else ""
    lines += ["", f"## Trials{more}", "", f"★: on the {'Pareto front' if several else 'best trial'}.", ""]
    lines += _table(["trial", "", *_header(report, keys), "settings"],
                    [[t["number"], "★" if t["number"] in front else "",
                      *(t["metrics"].get(k, "-") if t["state"] == "COMPLETE" else "failed" for k in keys),
                      _settings(t["params"]) + (f" — {t['error']}" if t.get("error") else "")] for t in shown])
    lines += ["", "## Links", "", *_links(report)]
    return "\n".join(lines) + "\n"


def trials_table(report: SweepReport) -> list[dict[str, Any]]:
    """The trials as rows of one shape (a Prefect table artifact): trial, front, state, each measured value by
    its metric name, each swept key ("" where a trial did not draw it)."""
    keys = _metric_keys(report)
    params = list(dict.fromkeys(k for t in report.trials for k in t["params"]))
    front = {row["number"] for row in report.pareto}
    return [{"trial": t["number"], "pareto": t["number"] in front, "state": t["state"],
             **{METRIC_NAMES[k]: t["metrics"].get(k, "") for k in keys},
             **{k: t["params"].get(k, "") for k in params}} for t in report.trials]


def print_report(report: SweepReport, console: Any = None) -> None:
    """The summary (`summary_markdown`) on the terminal, links written out."""
    (console or Console()).print(Markdown(summary_markdown(report), hyperlinks=False))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tidal sweep", description="Optuna sweep of scheduler policy settings.")
    ap.add_argument("space", metavar="SPACE", help="sweep space YAML (top-level `space:`), e.g. "
                                                   "experiments/sweep_policy.yaml")
    ap.add_argument("--trials", type=int, default=16, help="trials to add to the study (default 16)")
    ap.add_argument("--real", action="store_true", help="real training runs instead of the simulator")
    ap.add_argument("--json", metavar="PATH", help="write the report (best_params, best_values, n_trials, pareto)")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="override of the base config (real runs and tracking), e.g. tracking.db_url=sqlite:///x.db")
    ap.add_argument("--storage", help="Optuna storage URL (default: $TIDAL_OPTUNA_STORAGE, else tracking.db_url)")
    ap.add_argument("--study", help="study name (default: the space's `study` + -sim / -real)")
    args = ap.parse_args(argv)
    for k, v in {"MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0", "DO_NOT_TRACK": "1"}.items():
        os.environ.setdefault(k, v)
    console = Console()
    space = load_space(args.space)

    def on_trial(r: TrialResult) -> None:
        vals = ", ".join(f"{k} {_fmt(r.values[k])}" for k in space.objectives) if r.values else r.error
        console.print(f"trial {r.number:>3} {r.state.lower():<8} "
                      f"{', '.join(f'{k}={_fmt(v)}' for k, v in r.params.items())}  ->  {vals}")

    report = run_sweep(space, args.trials, real=args.real, overrides=args.override, storage=args.storage,
                       study=args.study, on_trial=on_trial)
    print_report(report, console)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    return 0
