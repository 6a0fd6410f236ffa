"""`rl-training`: one flow run = one training run; each RL step is a subflow run.

    rl_training(request)                         request: config path, typed fields, overrides, resume_from (a form
                                                 in the UI)
      run = open_run(request)                    task "open-run", a log line per stage: config (and a resume
                                                 checkpoint) checked, database row + MLflow run (then at once the
                                                 progress artifact and the MLflow run's artifact), model loaded, Ray
                                                 and N workers started, weights placed (the resumed state), first
                                                 evaluation
      run_loop(FlowRun(run), run.loop, run.first_step)     tidal.pipeline.run_loop, the loop `tidal train` runs:
          keep_host_copy                         actor.redundancy: host: the state before the first step
          for each step (0-based: step 0 is the first, as in MLflow, the timeline and the database; a resumed run
          starts at the step its checkpoint names):
              rl_step(run, plan)                 subflow "rl-step", flow run name step-N, the plan's phases:
                  run_step                          generate | score | train iters, streaming on the workers
                  sync_weights                      new weights to rollout + inference (next policy version)
                  evaluate                          held-out accuracy of those weights (when due)
                  record_step                       metrics, events -> MLflow; rows -> database
                  checkpoint | keep_host_copy       a resumable checkpoint generation (when due), else the host copy
              report_step(run, step, metrics)    "step N of M ..." and the step's run warnings in this flow
                                                 run's log; its progress artifact
              a device lost beyond what the step absorbs (its subflow fails): recover_run, the run goes on in this
              process from its newest state (on the surviving workers where they can), at the step it names
              (run.max_restarts times)
          finish_run(run)                        timeline.png, events.json, summary.json
          report_run(run, summary)               markdown artifact: summary table, the MLflow run's page
          close_run(run, status)                 workers down; MLflow run and database row end as
                                                 FINISHED/FAILED/KILLED

The live `TrainingRun` (and its Ray workers) stays in this flow run's process; tasks get its registry key.
Runs anywhere Prefect runs: against the server in `PREFECT_API_URL` (`tidal up`, compose) or, with none, a
temporary local one. Served as a deployment by `tidal serve`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.requests import TrainingRequest
from tasks.training import (
    OpenedRun,
    Recoverable,
    StepPlan,
    StepTasks,
    close_run,
    finish_run,
    keep_host_copy,
    open_run,
    recover_run,
    report_run,
    report_step,
    run_loop,
    run_phases,
)


@flow(name="rl-step", flow_run_name="step-{plan.step}")
def rl_step(run: OpenedRun, plan: StepPlan) -> dict[str, float]:
    """One RL step of an open run, its phases as `plan` names them; returns the metrics it recorded.

    Generation, scoring and the actor's iters overlap inside `run_step` (the pipeline streams); the phases after
    it each need the one before: evaluation measures the synced weights, the record holds the evaluation, and a
    checkpoint is taken between steps (it names the steps completed)."""
    return run_phases(plan, StepTasks(run.key))


class FlowRun:
    """The run loop's verbs (`tidal.pipeline.run_loop.RunVerbs`) as this flow's tasks and subflows."""

    def __init__(self, run: OpenedRun):
        self.run = run

    def keep_host_copy(self) -> str:
        return keep_host_copy(self.run.key)

    def step(self, plan: StepPlan) -> dict[str, float]:
        return rl_step(self.run, plan)

    def recover(self, failure: Recoverable) -> int:
        return recover_run(self.run.key, failure)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        report_step(self.run, step, metrics)

    def finish(self) -> dict[str, Any]:
        summary = finish_run(self.run.key)
        report_run(self.run, summary)
        return {**summary, "db_run_id": self.run.db_run_id, "mlflow_run_id": self.run.mlflow_run_id}

    def close(self, status: str) -> None:
        close_run(self.run.key, status)


@flow(name="rl-training")   # no flow_run_name: the name given in the UI's form (or Prefect's own) stays
def rl_training(request: TrainingRequest = TrainingRequest()) -> dict[str, Any]:
    """Train with GRPO on the request's config (from its `resume_from` checkpoint, if given); returns the run
    summary."""
    run = open_run(request)
    return run_loop(FlowRun(run), run.loop, run.first_step)
