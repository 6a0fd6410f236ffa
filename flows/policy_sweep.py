"""`policy-sweep`: an Optuna study of the scheduler's settings, one trial after another.

    policy_sweep(request)                 request: sweep space path, trials, simulator or real runs
      sweep = open_sweep(request)         study in the platform database, MLflow parent run
      sweep_loop(SweepTasks(sweep), request.trials)      tidal.sweep.sweep_loop, the loop `tidal sweep` runs:
          repeat request.trials times:
              spec = ask_trial(sweep)     the sampler's next settings
              run_trial(sweep, spec)      simulate (or train for real); MLflow child run; tell the study
          report_sweep(sweep)             best settings + Pareto front (same JSON as `tidal sweep --json`);
                                          artifacts <study>-summary (the summary `tidal sweep` prints: best
                                          settings to paste, front, trials, links) and <study>-trials (a table)
          close_sweep(sweep, status)      the MLflow parent run ends FINISHED / FAILED / KILLED

The space format and the objectives are documented in `tidal.sweep`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.requests import SweepRequest
from tasks.sweep import SweepTasks, open_sweep, sweep_loop


@flow(name="policy-sweep", flow_run_name="{request.space}")
def policy_sweep(request: SweepRequest = SweepRequest()) -> dict[str, Any]:
    """Sweep the scheduler's settings; returns the report (best_params, best_values, n_trials, pareto)."""
    return sweep_loop(SweepTasks(open_sweep(request)), request.trials)
