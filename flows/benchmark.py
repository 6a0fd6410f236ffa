"""`benchmark`: compare scheduler policies on one workload: simulated side by side, optionally for real.

    benchmark(request)                          request: workload, policies, devices, steps, seed, real
      for each policy, concurrently:  simulate_policy(workload, policy, ...)     (seconds)
      if request.real, one after another:  rl_training(config + scheduler.policy=P)   (a subflow each:
                                           its own MLflow run and database rows, every device of the machine)
      write_comparison(...)                     rows per policy, speed-up vs static; JSON at request.json_path
"""

from __future__ import annotations

from prefect import flow

from flows.rl_training import rl_training
from tasks.benchmark import simulate_policy, write_comparison
from tasks.requests import BenchmarkRequest, TrainingRequest
from tidal.core.errors import TidalError


@flow(name="benchmark", flow_run_name="{request.workload}")
def benchmark(request: BenchmarkRequest = BenchmarkRequest()) -> dict:
    """Simulated (and optionally real) comparison of scheduler policies; returns the comparison."""
    if request.real and request.workload == "rlinf-example":
        raise TidalError("workload", request.workload, "real runs need a config file",
                         "pass a config path, e.g. experiments/rlinf_dynamic.yaml")
    sims = [simulate_policy.submit(request.workload, p, request.devices, request.steps, request.seed)
            for p in request.policies]
    real = [rl_training(TrainingRequest(config=request.workload, overrides=[
        *request.overrides, "cluster.auto_scheduler=true", f"scheduler.policy={p}", f"run.num_steps={request.steps}",
        f"run.name=benchmark-{p}"])) for p in request.policies] if request.real else []
    return write_comparison([f.result() for f in sims], real, request.json_path)
