"""Prefect tasks of a policy sweep: verbs over a `tidal.sweep.Sweep` living in the flow run's process.

    open_sweep(request) -> key      study in the storage, MLflow parent run
    ask_trial(key) -> TrialSpec     the sampler's next settings (number + params: small values)
    run_trial(key, spec)            simulator or a real training run; MLflow child run; tell Optuna
    report_sweep(key) -> dict       best settings, Pareto front (the `tidal sweep --json` report); the flow run's
                                    artifacts: `<study>-summary` (markdown: best settings as a config snippet, the
                                    front, the trials, links to optuna-dashboard and the MLflow parent run) and
                                    `<study>-trials` (a table, one row per trial)
    close_sweep(key, status)

`SweepTasks` is these verbs as `tidal.sweep.sweep_loop` asks for them, the loop `tidal sweep` runs too. Trials
run one after another: each `ask` sees every earlier result (TPE), and a real trial uses every device.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from tasks import registry
from tasks.reporting import artifact_key
from tasks.requests import SweepRequest
from tidal.sweep import Sweep, SweepReport, TrialResult, TrialSpec, load_space, summary_markdown, trials_table
from tidal.sweep import sweep_loop as sweep_loop  # the flow's loop: the same as `tidal sweep`'s


class SweepTasks:
    """The sweep loop's verbs (`tidal.sweep.SweepVerbs`) as this module's tasks on the open sweep `key`."""

    def __init__(self, key: str):
        self.key = key

    def ask(self) -> TrialSpec:
        return ask_trial(self.key)

    def evaluate(self, spec: TrialSpec) -> TrialResult:
        return run_trial(self.key, spec)

    def report(self) -> dict[str, Any]:
        return report_sweep(self.key)

    def close(self, status: str) -> None:
        close_sweep(self.key, status)


@task(name="open-sweep", cache_policy=NO_CACHE)
def open_sweep(request: SweepRequest) -> str:
    sweep = Sweep(load_space(request.space), real=request.real, overrides=request.overrides,
                  storage=request.storage)
    return registry.put("sweep", sweep)


@task(name="ask-trial", cache_policy=NO_CACHE)
def ask_trial(key: str) -> TrialSpec:
    return registry.get(key, "sweep").ask()


@task(name="run-trial", cache_policy=NO_CACHE, task_run_name="trial-{spec.number}")
def run_trial(key: str, spec: TrialSpec) -> TrialResult:
    return registry.get(key, "sweep").evaluate(spec)


@task(name="report-sweep", cache_policy=NO_CACHE)
def report_sweep(key: str) -> dict[str, Any]:
    """The study's report, shown on the flow run (`publish_report`); returns it as `tidal sweep --json` writes it."""
    report = registry.get(key, "sweep").report()
    publish_report(report)
    return report.to_json()


def publish_report(report: SweepReport) -> str:
    """The report as this flow run's artifacts (`<study>-summary`: `tidal.sweep.summary_markdown`; `<study>-trials`:
    one row per trial) and its best settings and links in the log; returns the markdown."""
    text = summary_markdown(report)
    create_markdown_artifact(text, key=artifact_key(report.study, "summary"),
                             description=f"sweep {report.study}: best settings, Pareto front, trials, links")
    create_table_artifact(trials_table(report), key=artifact_key(report.study, "trials"),
                          description=f"sweep {report.study}: every trial, its values and settings")
    get_run_logger().info("sweep %s: %d complete trials, best trial %d: %s; MLflow parent run %s; study %s",
                          report.study, report.n_trials, report.best_trial,
                          ", ".join(f"{k}={v}" for k, v in report.best_params.items()),
                          report.mlflow_parent_run_url or report.mlflow_parent_run_id,
                          report.dashboard_url or f"{report.study} in {report.storage}")
    return text


@task(name="close-sweep", cache_policy=NO_CACHE)
def close_sweep(key: str, status: str) -> None:
    sweep = registry.pop(key)
    if sweep is not None:
        sweep.close(status)
