"""`policy-sweep`: an Optuna study of the scheduler's settings, one trial after another.

    policy_sweep(request)                 request: sweep space path, trials, simulator or real runs
      sweep = open_sweep(request)         study in the platform database, MLflow parent run
      repeat request.trials times:
          spec = ask_trial(sweep)         the sampler's next settings
          run_trial(sweep, spec)          simulate (or train for real); MLflow child run; tell the study
      report_sweep(sweep)                 best settings + Pareto front (same JSON as `tidal sweep --json`);
                                          artifacts <study>-summary (the summary `tidal sweep` prints: best
                                          settings to paste, front, trials, links) and <study>-trials (a table)

The space format and the objectives are documented in `tidal.sweep`.
"""

from __future__ import annotations

from prefect import flow

from tasks.requests import SweepRequest
from tasks.sweep import ask_trial, close_sweep, closing_status, open_sweep, report_sweep, run_trial


@flow(name="policy-sweep", flow_run_name="{request.space}")
def policy_sweep(request: SweepRequest = SweepRequest()) -> dict:
    """Sweep the scheduler's settings; returns the report (best_params, best_values, n_trials, pareto)."""
    sweep = open_sweep(request)
    status = "FAILED"
    try:
        for _ in range(request.trials):
            run_trial(sweep, ask_trial(sweep))
        report = report_sweep(sweep)
        status = "FINISHED"
        return report
    except BaseException as stop:   # a Prefect cancel (TerminationSignal), Ctrl-C: KILLED; an error: FAILED
        status = closing_status(stop)
        raise
    finally:
        close_sweep(sweep, status)
