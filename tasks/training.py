"""Prefect tasks of a training run: verbs over a `TrainingRun` that lives in the flow run's process.

Tasks pass a run key (a string; see `tasks.registry`) and small typed values (metrics dicts, paths),
never tensors: Prefect pickles results. `cache_policy=NO_CACHE` everywhere: each call acts on live workers
and must run every time.

One step, and who waits on whom::

    run_step ──► sync_weights ──► evaluate ──► record_step ──► checkpoint
    (generate | score | train iters        (if due)   (MLflow +      (if due; between steps:
     stream concurrently on the workers)               database)      a resumable generation)

`run_step` drives the streaming pipeline: generation, scoring and the actor's train iters run concurrently
on the workers inside it (one driver event loop, rollout -> inference -> actor, whole groups at a time), so it
is one task; splitting it would serialise what streams. The phases after it each need the previous one
(evaluation measures the synced weights; the step's record holds the evaluation; a checkpoint is taken
between steps and names the steps completed), so they are tasks of their own, in sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from tasks import registry
from tasks.reporting import artifact_key, mlflow_run_markdown, progress_percent, step_line, summary_markdown
from tasks.requests import TrainingRequest
from tidal.pipeline.tracked_run import RunTracking, load_run_config, policy_name, run_dir
from tidal.tracking import MlflowSink

if TYPE_CHECKING:
    from tidal.core.config import TidalConfig
    from tidal.pipeline.run import TrainingRun

log = logging.getLogger("tidal.tasks")


@dataclass(frozen=True)
class OpenedRun:
    """What the flow needs to know about an open run (small and picklable)."""

    key: str                     #: registry key of the live TrainingRun in this process
    name: str
    num_steps: int
    policy: str
    output_dir: str
    db_run_id: int | None
    mlflow_run_id: str | None
    progress_artifact_id: str | None = None   #: the flow run's progress artifact (steps done, in percent)


@dataclass(frozen=True)
class StepOutcome:
    """The result of `run_step`, and which of the step's later phases are due."""

    step: int
    seconds: float
    reward_mean: float
    evaluate: bool               #: held-out evaluation due after this step (run.eval_every, last step)
    checkpoint: bool             #: checkpoint due (run.checkpoint_every; 0: only at the end)


@dataclass
class _Live:
    run: TrainingRun
    tracking: RunTracking


def _live(key: str) -> _Live:
    return registry.get(key, "run")


@task(name="open-run", cache_policy=NO_CACHE)
def prefect_links() -> dict[str, str]:
    """The flow run this task belongs to, as MLflow tags: its id and its page in the Prefect UI (when known)."""
    links = {"prefect.flow_run_id": str(flow_run.id or ""), "prefect.flow_run_name": str(flow_run.name or ""),
             "prefect.flow_run_url": str(flow_run.ui_url or "")}
    return {k: v for k, v in links.items() if v}


def open_tracking(cfg: TidalConfig, out: Path) -> RunTracking:
    """The run's database row and MLflow run, each holding the other's id and this flow run's id."""
    links = prefect_links()
    return RunTracking.open(cfg, out, tags=links, prefect_flow_run_id=links.get("prefect.flow_run_id"))


def open_run(request: TrainingRequest) -> OpenedRun:
    """Config, tracking (database row + MLflow run), warm start, workers; the run stays open in this process."""
    from tidal.pipeline.preflight import preflight
    from tidal.pipeline.run import TrainingRun
    cfg = load_run_config(request.config, request.config_overrides())
    request.check_against(cfg)
    checked = preflight(cfg, tracked=request.track)   # before the run's folder and records exist
    out = run_dir(cfg)
    tracking = open_tracking(cfg, out) if request.track else RunTracking.null(cfg)
    logger = get_run_logger()   # the flow run's log in the Prefect UI: the warm start's progress shows there
    run = TrainingRun(cfg, out, tracking.sink, tracking.recorder,
                      log_fn=lambda p: logger.info("warm start iter %d: loss %.3f held-out %.3f", p.iter, p.loss,
                                                   p.heldout_accuracy))
    try:
        run.open(checked=checked)
    except BaseException:
        tracking.close("FAILED")
        raise
    key = registry.put("run", _Live(run, tracking))
    progress = create_progress_artifact(0.0, key=artifact_key(cfg.run.name, "progress"),
                                        description=f"{cfg.run.name}: RL steps done of {cfg.run.num_steps}")
    return OpenedRun(key, cfg.run.name, cfg.run.num_steps, policy_name(cfg), str(out), tracking.db_run_id,
                     tracking.mlflow_run_id, str(progress))


def report_step(run: OpenedRun, step: int, metrics: dict[str, float]) -> None:
    """After step `step`: one line in this flow run's log (`tasks.reporting.step_line`) and the progress artifact
    at the steps done. Called from the flow, so the line is the flow run's own, not a subflow's or a task's."""
    get_run_logger().info("%s", step_line(step, run.num_steps, metrics))
    if run.progress_artifact_id is not None:
        update_progress_artifact(UUID(run.progress_artifact_id), progress_percent(step + 1, run.num_steps))


def report_run(run: OpenedRun, summary: dict) -> str:
    """The run's summary table and the way to its MLflow run, as this flow run's markdown artifact (key
    `<run name>-summary`); returns the markdown."""
    sink = _live(run.key).tracking.sink
    uri, exp = (sink.uri, sink.experiment_id) if isinstance(sink, MlflowSink) else (None, None)
    text = summary_markdown(summary, mlflow_run_markdown(uri, exp, run.mlflow_run_id))
    create_markdown_artifact(text, key=artifact_key(run.name, "summary"),
                             description=f"{run.name}: summary of the run and its MLflow run")
    return text


@task(name="run-step", cache_policy=NO_CACHE)
def run_step(key: str, step: int) -> StepOutcome:
    """Generate, score and train the step's iters, streaming (the scheduler acts at iter boundaries)."""
    live = _live(key)
    run = live.run
    if run.next_step != step:  # our invariant: steps run once, in order (no task retries here)
        raise RuntimeError(f"run {key} is at step {run.next_step}, asked to run step {step}")
    m = run.run_step(sync=False)
    every = run.cfg.run.checkpoint_every
    last = step == run.cfg.run.num_steps - 1
    return StepOutcome(step, float(m["step/time_s"]), float(m.get("grpo/reward_mean", 0.0)), run.eval_due(),
                       last or (every > 0 and (step + 1) % every == 0))


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
def keep_host_copy(key: str) -> str | None:
    """`actor.redundancy: host`: the run's state into host memory (between steps, where no checkpoint is taken), so
    that a lost actor device costs only the step in progress; returns its folder (None without redundancy)."""
    run = _live(key).run
    return str(run.keep_host_copy()) if run.cfg.actor.redundancy == "host" else None


def recoverable() -> tuple[type[BaseException], ...]:
    """The failures `recover_run` answers (`tidal.pipeline.run.RECOVERABLE`: a device lost beyond what a step
    absorbs, a hung call)."""
    from tidal.pipeline.run import RECOVERABLE
    return RECOVERABLE


@task(name="recover-run", cache_policy=NO_CACHE)
def recover_run(key: str, failure: BaseException) -> int:
    """A device lost beyond what its step absorbed (`failure`, one of `RECOVERABLE`): the run carries on in this
    process from its newest state kept (`TrainingRun.recover`: the surviving workers go on where they can). Returns
    the step to run next; raises the failure again when `run.max_restarts` are spent or no state is kept."""
    run = _live(key).run
    if len(run.restarts) >= run.cfg.run.max_restarts or not isinstance(failure, recoverable()):
        raise failure
    rec = run.recover(cast(Any, failure))   # one of RECOVERABLE, checked above
    get_run_logger().warning("device %d (%s) lost: the run goes on from step %d (the %s %s; workers %s)",
                             rec["device"], rec["role"], rec["resumed_step"], rec["source"],
                             Path(rec["resumed_from"]).name, rec["workers"])
    return run.next_step


@task(name="record-step", cache_policy=NO_CACHE)
def record_step(key: str) -> dict[str, float]:
    """The step's metrics and events to MLflow, its rows to the database; a warning the step raised goes to the
    flow run's log (tidal.pipeline.run_warnings)."""
    run = _live(key).run
    out = run.record()
    _log_warnings(run)
    return out


@task(name="finish-run", cache_policy=NO_CACHE)
def finish_run(key: str) -> dict:
    """Timeline, events and summary files; returns the summary (JSON-able)."""
    run = _live(key).run
    summary = run.finish().to_json()
    _log_warnings(run)
    return summary


def _log_warnings(run: TrainingRun) -> None:
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
