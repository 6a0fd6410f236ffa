"""Prefect tasks of a training run: verbs over a `TrainingRun` that lives in the flow run's process.

Tasks pass a run key (a string; see `tasks.registry`) and small typed values (metrics dicts, paths),
never tensors: Prefect pickles results. `cache_policy=NO_CACHE` everywhere: each call acts on live workers
and must run every time.

One step, and who waits on whom (the phases `tidal.pipeline.run_loop.plan_step` plans; `StepTasks` runs them as
this module's tasks)::

    run_step ──► sync_weights ──► evaluate ──► record_step ──► checkpoint | keep_host_copy
    (generate | score | train iters        (if due)   (MLflow +      (if due; between steps: a resumable
     stream concurrently on the workers)               database)      generation; else actor.redundancy: host's copy)

`run_step` drives the streaming pipeline: generation, scoring and the actor's train iters run concurrently
on the workers inside it (one driver event loop, rollout -> inference -> actor, whole groups at a time), so it
is one task; splitting it would serialise what streams. The phases after it each need the previous one
(evaluation measures the synced weights; the step's record holds the evaluation; a checkpoint is taken
between steps and names the steps completed), so they are tasks of their own, in sequence.

The opening is one task, `open-run` (config, tracking records, `TrainingRun.open`'s stages): the stages share the
live run they build, so they are one call; the task's log has a line per stage (`OpeningLog`), and its artifacts
(progress, the MLflow run's link) appear as soon as the MLflow run exists.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for

from tasks import registry
from tasks.reporting import artifact_key, mlflow_run_markdown, progress_percent, step_line, summary_markdown
from tasks.requests import TrainingRequest
from tidal.pipeline.run_loop import LoopSettings
from tidal.pipeline.run_loop import Recoverable as Recoverable  # what `recover_run` answers
from tidal.pipeline.run_loop import StepPlan as StepPlan  # the rl-step subflow's parameter
from tidal.pipeline.run_loop import run_loop as run_loop  # the flow's loop: the same as `run_training`'s
from tidal.pipeline.run_loop import run_phases as run_phases  # a step's phases in its plan's order
from tidal.pipeline.tracked_run import RunTracking, load_run_config, policy_name, run_dir
from tidal.tracking import NOTE_TAG, MlflowSink, flow_run_note

if TYPE_CHECKING:
    from tidal.core.config import TidalConfig
    from tidal.pipeline.run import TrainingRun

log = logging.getLogger("tidal.tasks")
#: seconds between the opening's lines while one stage goes on: the page never shows nothing for longer
HEARTBEAT_S = 5.0


@dataclass(frozen=True)
class OpenedRun:
    """What the flow needs to know about an open run (small and picklable)."""

    key: str                     #: registry key of the live TrainingRun in this process
    name: str
    policy: str
    output_dir: str
    db_run_id: int | None
    mlflow_run_id: str | None
    loop: LoopSettings           #: what the run loop reads of the run's config (steps, evaluation, checkpoints)
    first_step: int = 0          #: the step the loop starts at: 0, or the one the resumed checkpoint names
    progress_artifact_id: str | None = None   #: the flow run's progress artifact (steps done, in percent)

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps


@dataclass
class _Live:
    run: TrainingRun
    tracking: RunTracking


def _live(key: str) -> _Live:
    return registry.get(key, "run")


def flow_run_page() -> str | None:
    """This flow run's page in the Prefect UI (`PREFECT_UI_URL`, which Prefect derives from `PREFECT_API_URL`):
    None outside a flow run, or against a temporary server that serves no UI."""
    return url_for("flow-run", obj_id=flow_run.id) if flow_run.id else None


def prefect_links() -> dict[str, str]:
    """The flow run driving this code, as MLflow tags: its id, name and page (when known), and the MLflow run's
    description (`tidal.tracking.NOTE_TAG`): markdown the run page renders, a link back to the flow run."""
    fid, name, url = str(flow_run.id or ""), str(flow_run.name or ""), flow_run_page() or ""
    links = {"prefect.flow_run_id": fid, "prefect.flow_run_name": name, "prefect.flow_run_url": url,
             NOTE_TAG: flow_run_note(url, name, fid) or ""}
    return {k: v for k, v in links.items() if v}


def open_tracking(cfg: TidalConfig, out: Path) -> RunTracking:
    """The run's database row and MLflow run, each holding the other's id and this flow run's id (and its page,
    in the MLflow run's description)."""
    links = prefect_links()
    return RunTracking.open(cfg, out, tags=links, prefect_flow_run_id=links.get("prefect.flow_run_id"))


class OpeningLog:
    """The opening's progress as lines in the open-run task's log (the flow run's page shows them): one as each
    stage ends, saying what it did, how long it took and what comes next, so the page always names the stage under
    way. Stages: the config's checks, the tracking records, then `TrainingRun.open`'s (`OPEN_STAGES`), then "open".
    """

    def __init__(self, logger: Any, cfg: TidalConfig):
        self.logger, self.cfg = logger, cfg
        self.t_open = self.t_stage = time.monotonic()
        self.kind = "cpu"                    # the device kind, once the config's checks found it
        self.run: TrainingRun | None = None  # set once it exists: the lines after its stages read it
        self.current: str | None = None      # the stage of `TrainingRun.open` under way
        self._stop = threading.Event()       # set as the opening ends: the heartbeat stops
        self._beat: threading.Thread | None = None

    def __enter__(self) -> OpeningLog:
        """While the run opens, a line every HEARTBEAT_S that a stage goes on (Ray and the workers, a long warm
        start): the page never goes longer than that without one."""
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="opening-heartbeat", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=HEARTBEAT_S)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            stage = self.current
            if stage is not None and stage != "open":
                self.logger.info("... still %s (%.0f s)", self.begins(stage), time.monotonic() - self.t_stage)

    def say(self, done: str, next_: str | None) -> None:
        """`<done> (<seconds> s); <next>...`; the stage's clock restarts."""
        now = time.monotonic()
        self.logger.info("%s (%.1f s)%s", done, now - self.t_stage, f"; {next_}..." if next_ else "")
        self.t_stage = now

    def begins(self, stage: str) -> str:
        """What `stage` of `TrainingRun.open` does, as the line before it says."""
        return {"model": "loading the model (a checkpoint, the cached warm start, or a warm start)",
                "workers": f"starting Ray and {self.cfg.cluster.num_devices} workers ({self.kind} devices)",
                "pipeline": "placing the weights on the workers",
                "evaluation": f"the first held-out evaluation ({self.cfg.data.eval_size} prompts)"}.get(stage, stage)

    def ended(self, stage: str | None) -> str:
        """What `stage` of `TrainingRun.open` did, read from the run (None: the tracking records, just before)."""
        run = cast("TrainingRun", self.run)
        if stage is None:
            return "tracking ready"
        if stage == "model":
            meta = getattr(run, "ws_meta", {})
            acc = meta.get("heldout_accuracy")
            return f"model loaded: {meta.get('source', '?')}" + (f", held-out {acc:.3f}" if acc is not None else "")
        if stage == "workers":
            return f"Ray up, {self.cfg.cluster.num_devices} workers started"
        if stage == "pipeline":
            return "weights placed on the workers"
        return f"first evaluation: held-out accuracy {run.evals[-1][1]:.3f}"

    def stage(self, name: str) -> None:
        """`TrainingRun.open`'s `on_stage`: the line between the stage that ended and `name`."""
        done, self.current = self.ended(self.current), name
        if name != "open":
            self.say(done, self.begins(name))
            return
        self.say(done, None)
        self.logger.info("run open after %.1f s: step %d of %d next", time.monotonic() - self.t_open,
                         cast("TrainingRun", self.run).next_step, self.cfg.run.num_steps)


@task(name="open-run", cache_policy=NO_CACHE)
def open_run(request: TrainingRequest) -> OpenedRun:
    """Config, tracking (database row + MLflow run), warm start, workers, and the resumed state of
    `request.resume_from`; the run stays open in this process.

    A task, so the flow run's page shows the opening as it goes: a line in this task's log per stage
    (`OpeningLog`), and, as soon as the MLflow run exists, the run's progress artifact and a markdown artifact with
    the way to its MLflow run."""
    from tidal.pipeline.preflight import preflight
    from tidal.pipeline.run import TrainingRun
    logger = get_run_logger()   # this task's log, on the flow run's page
    logger.info("opening the run: checking the config %s", request.config)
    cfg = load_run_config(request.config, request.config_overrides())
    opening = OpeningLog(logger, cfg)
    request.check_against(cfg)
    logger.info("settings of this run:\n%s", "\n".join(request.effective(cfg)))
    # before the run's folder and records exist: a resume checkpoint too (complete, this model's, steps left)
    checked = preflight(cfg, tracked=request.track, resume_from=request.resume_from)
    out = run_dir(cfg)
    opening.kind = checked[1]
    resuming = f", resuming from {request.resume_from}" if request.resume_from else ""
    opening.say(f"config checked: {cfg.run.name}, {cfg.run.num_steps} steps, policy {policy_name(cfg)}, "
                f"{cfg.cluster.num_devices} {checked[1]} devices{resuming}", "opening the tracking records")
    tracking = open_tracking(cfg, out) if request.track else RunTracking.null(cfg)
    progress = _announce(cfg, tracking, logger)
    run = TrainingRun(cfg, out, tracking.sink, tracking.recorder,
                      log_fn=lambda p: logger.info("warm start iter %d: loss %.3f held-out %.3f", p.iter, p.loss,
                                                   p.heldout_accuracy))
    opening.run = run
    try:
        with opening:
            run.open(resume_from=request.resume_from, checked=checked, on_stage=opening.stage)
    except BaseException:
        tracking.close("FAILED")
        raise
    _log_warnings(run)
    key = registry.put("run", _Live(run, tracking))
    return OpenedRun(key, cfg.run.name, policy_name(cfg), str(out), tracking.db_run_id, tracking.mlflow_run_id,
                     LoopSettings.from_config(cfg), run.next_step, progress)


def _announce(cfg: TidalConfig, tracking: RunTracking, logger: Any) -> str:
    """As soon as the run's records exist: its progress artifact (0 %), a markdown artifact with the way to its
    MLflow run (key `<run name>-mlflow`) and the same in the log. Returns the progress artifact's id."""
    sink = tracking.sink
    uri, exp = (sink.uri, sink.experiment_id) if isinstance(sink, MlflowSink) else (None, None)
    mlflow = mlflow_run_markdown(uri, exp, tracking.mlflow_run_id)
    progress = create_progress_artifact(0.0, key=artifact_key(cfg.run.name, "progress"),
                                        description=f"{cfg.run.name}: RL steps done of {cfg.run.num_steps}")
    create_markdown_artifact(f"# {cfg.run.name}\n\n{mlflow}\n\nDatabase row: {tracking.db_run_id}\n",
                             key=artifact_key(cfg.run.name, "mlflow"),
                             description=f"{cfg.run.name}: its MLflow run, from the start")
    logger.info("tracking: database row %s; %s", tracking.db_run_id, mlflow)
    return str(progress)


def report_step(run: OpenedRun, step: int, metrics: dict[str, float]) -> None:
    """After step `step`: one line in this flow run's log (`tasks.reporting.step_line`), the warnings the step
    raised, and the progress artifact at the steps done. Called from the flow, so the lines are the flow run's
    own, not a subflow's or a task's: the run's page holds every step and every warning."""
    get_run_logger().info("%s", step_line(step, run.num_steps, metrics))
    _log_warnings(_live(run.key).run)
    if run.progress_artifact_id is not None:
        update_progress_artifact(UUID(run.progress_artifact_id), progress_percent(step + 1, run.num_steps))


def report_run(run: OpenedRun, summary: dict[str, Any]) -> str:
    """The run's summary table and the way to its MLflow run, as this flow run's markdown artifact (key
    `<run name>-summary`); returns the markdown."""
    sink = _live(run.key).tracking.sink
    uri, exp = (sink.uri, sink.experiment_id) if isinstance(sink, MlflowSink) else (None, None)
    text = summary_markdown(summary, mlflow_run_markdown(uri, exp, run.mlflow_run_id))
    create_markdown_artifact(text, key=artifact_key(run.name, "summary"),
                             description=f"{run.name}: summary of the run and its MLflow run")
    return text


class StepTasks:
    """The phases of one step (`tidal.pipeline.run_loop.StepVerbs`) as this module's tasks on the run `key`: the
    `rl-step` subflow runs them in its plan's order (`run_phases`), each a task run of its own."""

    def __init__(self, key: str):
        self.key = key

    def run_step(self, step: int) -> dict[str, float]:
        return run_step(self.key, step)

    def sync_weights(self) -> dict[str, float]:
        return sync_weights(self.key)

    def evaluate(self) -> float:
        return evaluate(self.key)

    def record(self) -> dict[str, float]:
        return record_step(self.key)

    def checkpoint(self) -> str:
        return checkpoint(self.key)

    def keep_host_copy(self) -> str:
        return keep_host_copy(self.key)


@task(name="run-step", cache_policy=NO_CACHE)
def run_step(key: str, step: int) -> dict[str, float]:
    """Generate, score and train the step's iters, streaming (the scheduler acts at iter boundaries); returns the
    stream's metrics (`record_step` writes them, with the later phases')."""
    run = _live(key).run
    if run.next_step != step:  # our invariant: steps run once, in order (no task retries here)
        raise RuntimeError(f"run {key} is at step {run.next_step}, asked to run step {step}")
    return run.run_step(sync=False)


@task(name="sync-weights", cache_policy=NO_CACHE)
def sync_weights(key: str) -> dict[str, float]:
    """Actor weights to rollout and inference (the next policy version)."""
    return _live(key).run.sync_weights()


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(key: str) -> float:
    """Held-out accuracy of the synced weights (on an inference device)."""
    return _live(key).run.evaluate()


@task(name="checkpoint", cache_policy=NO_CACHE)
def checkpoint(key: str) -> str:
    """A checkpoint generation of the run after the recorded steps (`<run dir>/checkpoints/gen-N`, resumable;
    see `tidal.pipeline.checkpointing`); returns its path."""
    return str(_live(key).run.checkpoint())


@task(name="keep-host-copy", cache_policy=NO_CACHE)
def keep_host_copy(key: str) -> str:
    """`actor.redundancy: host` (the run loop asks for it only then): the run's state into host memory (before the
    first step, and between steps where no checkpoint is taken), so that a lost actor device costs only the step
    in progress; returns its folder."""
    return str(_live(key).run.keep_host_copy())


@task(name="recover-run", cache_policy=NO_CACHE)
def recover_run(key: str, failure: Recoverable) -> int:
    """A device lost beyond what its step absorbed (`failure`, one of `tidal.pipeline.run_loop.RECOVERABLE`; the
    run loop has checked `run.max_restarts`): the run carries on in this process from its newest state kept
    (`TrainingRun.recover`: the surviving workers go on where they can). Returns the step to run next; raises the
    failure again when no state is kept."""
    run = _live(key).run
    rec = run.recover(failure)
    get_run_logger().warning("device %d (%s) lost: the run goes on from step %d (the %s %s; workers %s)",
                             rec["device"], rec["role"], rec["resumed_step"], rec["source"],
                             Path(rec["resumed_from"]).name, rec["workers"])
    return run.next_step


@task(name="record-step", cache_policy=NO_CACHE)
def record_step(key: str) -> dict[str, float]:
    """The step's metrics and events to MLflow, its rows to the database. A warning the step raised
    (tidal.pipeline.run_warnings) waits for `report_step`, which logs it on the run's own flow run."""
    return _live(key).run.record()


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(key: str) -> dict[str, Any]:
    """Timeline, events and summary files; returns the summary (JSON-able)."""
    run = _live(key).run
    summary = run.finish().to_json()
    _log_warnings(run)
    return summary


def _log_warnings(run: TrainingRun) -> None:
    """The run's warnings not yet shown, as warnings in the log of the flow run or task calling this."""
    for w in run.drain_warnings():
        get_run_logger().warning("%s", w.message)


@task(name="close-run", cache_policy=NO_CACHE)
def close_run(key: str, status: str) -> None:
    """Stop the workers; end the MLflow run and the database row with `status` (FINISHED, FAILED, KILLED)."""
    live: _Live | None = registry.pop(key)
    if live is None:
        return
    try:
        live.run.close()
        live.run.drop_host_copy()
    finally:
        out = Path(live.run.out_dir)
        live.tracking.close(status, [out / n for n in ("timeline.png", "summary.json", "events.json")])
