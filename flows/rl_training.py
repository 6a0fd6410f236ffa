"""`rl-training`: one flow run = one training run; each RL step is a subflow run.

    rl_training(request)                         request: config path, typed fields, overrides (a form in the UI)
      run = open_run(request)                    task "open-run", a log line per stage: config checked, database
                                                 row + MLflow run (then at once the progress artifact and the
                                                 MLflow run's artifact), model loaded, Ray and N workers started,
                                                 weights placed, first evaluation
      keep_host_copy                             actor.redundancy: host: the state before the first step
      for each step (0-based: step 0 is the first, as in MLflow, the timeline and the database):
          rl_step(run, step)                     subflow "rl-step", flow run name step-N:
              run_step                              generate | score | train iters, streaming on the workers
              sync_weights                          new weights to rollout + inference (next policy version)
              evaluate                              held-out accuracy of those weights (when due)
              record_step                           metrics, events -> MLflow; rows -> database
              checkpoint | keep_host_copy           a resumable checkpoint generation (when due), else the host copy
          report_step(run, step, metrics)        "step N of M ..." and the step's run warnings in this flow
                                                 run's log; its progress artifact
          a device lost beyond what the step absorbs (its subflow fails): recover_run, the run goes on in this
          process from its newest state (on the surviving workers where they can), at the step it names
          (run.max_restarts times)
      finish_run(run)                            timeline.png, events.json, summary.json
      report_run(run, summary)                   markdown artifact: summary table, the MLflow run's page
      close_run(run, status)                     workers down; MLflow run and database row end as FINISHED/FAILED

The live `TrainingRun` (and its Ray workers) stays in this flow run's process; tasks get its registry key.
Runs anywhere Prefect runs: against the server in `PREFECT_API_URL` (`tidal up`, compose) or, with none, a
temporary local one. Served as a deployment by `tidal serve`.
"""

from __future__ import annotations

from prefect import flow

from tasks.requests import TrainingRequest
from tasks.training import (
    OpenedRun,
    checkpoint,
    close_run,
    closing_status,
    evaluate,
    finish_run,
    keep_host_copy,
    open_run,
    record_step,
    recover_run,
    recoverable,
    report_run,
    report_step,
    run_step,
    sync_weights,
)


@flow(name="rl-step", flow_run_name="step-{step}")
def rl_step(run: OpenedRun, step: int) -> dict[str, float]:
    """One RL step of an open run; returns the metrics it recorded.

    Generation, scoring and the actor's iters overlap inside `run_step` (the pipeline streams); the phases after
    it each need the one before: evaluation measures the synced weights, the record holds the evaluation, and a
    checkpoint is taken between steps (it names the steps completed)."""
    outcome = run_step(run.key, step)
    sync_weights(run.key)
    if outcome.evaluate:
        evaluate(run.key)
    metrics = record_step(run.key)
    if outcome.checkpoint:
        checkpoint(run.key)
    else:
        keep_host_copy(run.key)
    return metrics


@flow(name="rl-training")   # no flow_run_name: the name given in the UI's form (or Prefect's own) stays
def rl_training(request: TrainingRequest = TrainingRequest()) -> dict:
    """Train with GRPO on the request's config; returns the run summary."""
    run = open_run(request)
    status = "FAILED"
    try:
        keep_host_copy(run.key)
        step = 0
        while step < run.num_steps:
            try:
                report_step(run, step, rl_step(run, step))
                step += 1
            except recoverable() as failure:
                step = recover_run(run.key, failure)
        summary = finish_run(run.key)
        report_run(run, summary)
        status = "FINISHED"
        return {**summary, "db_run_id": run.db_run_id, "mlflow_run_id": run.mlflow_run_id}
    except BaseException as stop:   # a Prefect cancel (TerminationSignal), Ctrl-C: KILLED; an error: FAILED
        status = closing_status(stop)
        raise
    finally:
        close_run(run.key, status)
