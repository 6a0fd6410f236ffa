"""Prefect tasks of a policy sweep: verbs over a `tidal.sweep.Sweep` living in the flow run's process.

    open_sweep(request) -> key      study in the storage, MLflow parent run
    ask_trial(key) -> TrialSpec     the sampler's next settings (number + params: small values)
    run_trial(key, spec)            simulator or a real training run; MLflow child run; tell Optuna
    report_sweep(key) -> dict       best settings, Pareto front (the `tidal sweep --json` report)
    close_sweep(key, status)

Trials run one after another: each `ask` sees every earlier result (TPE), and a real trial uses every device.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import registry
from tasks.requests import SweepRequest
from tidal.sweep import Sweep, TrialResult, TrialSpec, load_space


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
def report_sweep(key: str) -> dict:
    return registry.get(key, "sweep").report().to_json()


@task(name="close-sweep", cache_policy=NO_CACHE)
def close_sweep(key: str, status: str) -> None:
    sweep = registry.pop(key)
    if sweep is not None:
        sweep.close(status)
