"""Prefect tasks of the `benchmark` flow: one simulated policy, and the comparison written as JSON.

`simulate_policy` returns `SimResult.to_json()` without the event list (small, picklable); the flow submits one
per policy, so they run side by side on the flow's thread pool.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from scheduler.policies import POLICIES
from scheduler.simulator import simulate
from scheduler.workload import rlinf_example
from tidal.core.errors import TidalError
from tidal.pipeline.tracked_run import load_run_config


@task(name="simulate-policy", cache_policy=NO_CACHE, task_run_name="simulate-{policy}")
def simulate_policy(workload: str, policy: str, devices: int | None, steps: int, seed: int) -> dict:
    """Simulate `steps` RL steps of the workload (`rlinf-example` or a config path) under `policy`."""
    if policy not in POLICIES:
        raise TidalError("policies", policy, "unknown policy", f"use some of {sorted(POLICIES)}")
    spec = rlinf_example(devices or 8) if workload == "rlinf-example" else load_run_config(workload)
    res = simulate(spec, policy, devices, steps, seed, keep_events=False).to_json()
    res.pop("events")
    res["reshards"] = sum(s["reshards"] for s in res["steps"])
    res["migrations"] = sum(s["migrations"] for s in res["steps"])
    return res


@task(name="write-comparison", cache_policy=NO_CACHE)
def write_comparison(simulated: list[dict], real: list[dict], json_path: str | None) -> dict:
    """Rows per policy (simulated, and real where run), speed-up against static; written to `json_path`."""
    base = next((r["mean_step_s"] for r in simulated if r["policy"] == "static"), None)
    rows = [{"policy": r["policy"], "mean_step_s": r["mean_step_s"], "idle_fraction": r["idle_fraction"],
             "reshards": r["reshards"], "migrations": r["migrations"],
             "speedup_vs_static": base / r["mean_step_s"] if base else None} for r in simulated]
    out = {"simulated": rows, "real": [
        {"policy": r["policy"], "mean_step_s": sum(r["step_seconds"]) / max(1, len(r["step_seconds"])),
         "idle_fraction": r["device_idle_fraction"], "reshards": r["reshards"], "migrations": r["migrations"],
         "eval_accuracy_end": r["eval_accuracy_end"], "mlflow_run_id": r.get("mlflow_run_id"),
         "db_run_id": r.get("db_run_id")} for r in real]}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=1))
    return out
