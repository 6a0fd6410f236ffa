"""Scheduler benchmark: policy decision latency and simulated step times.

    python benchmarks/scheduler.py --json benchmarks/results/scheduler.json [--steps 10] [--big-steps 3]

1. Decision latency (p50/p99 over repeated calls) of `rlinf` and `tidal` at 8, 64 and 1,024 devices on
   synthetic mid-step signals (RLinf example placement, every rollout instance busy, actor at a boundary).
2. Simulator figures: mean step time of static, rlinf (flags off and on) and tidal on RLinf's 8-GPU example,
   and on the same shape at 1,024 devices (2 prompts per device), with speedups and simulator wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

from tidal.devices import Owner
from tidal.scheduler.costs import gpu_h200_1p5b
from tidal.scheduler.policies import get_policy
from tidal.scheduler.signals import (ActorSignal, DeviceSignal, InferenceSignal, RolloutInstanceSignal,
                                     Signals)
from tidal.scheduler.simulator import simulate
from tidal.scheduler.state import SchedState
from tidal.scheduler.workload import rlinf_example


def synthetic(devices: int, seed: int = 0) -> tuple[SchedState, Signals]:
    spec = rlinf_example(devices, prompts_per_device=8)
    p = spec.params
    rng = random.Random(seed)
    rollout = []
    for d in p.rollout_devices:
        running = rng.randint(0, 400)
        rollout.append(RolloutInstanceSignal(d, (d,), rng.randint(0, 5), max(1, running // 16), running, 2048,
                                             rng.randint(0, 10**6), running * 900, 20_000.0 * rng.random(),
                                             running * 1500.0))
    owners = [Owner.ACTOR] * devices
    for d in p.rollout_devices:
        owners[d] = Owner.ROLLOUT
    for d in p.inference_devices:
        owners[d] = Owner.INFERENCE
    sig = Signals(100.0, 0, tuple(rollout), InferenceSignal(p.inference_devices, 10, p.rollout_batch_size // 3, False),
                  ActorSignal(1, p.n_minibatches, True, p.initial_layout, 30.0), DeviceSignal(tuple(owners)),
                  p.rollout_batch_size, p.rollout_batch_size // 2, True, "boundary")
    return SchedState(p, gpu_h200_1p5b(), 1700.0, 256.0), sig


def latency(policy: str, devices: int, reps: int) -> dict:
    st, sig = synthetic(devices)
    fn = get_policy(policy)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(st, sig, sig.time)
        times.append(time.perf_counter() - t)
    times.sort()
    return {"p50_ms": 1e3 * statistics.median(times), "p99_ms": 1e3 * times[int(0.99 * (len(times) - 1))]}


def sim_figures(devices: int, steps: int, prompts_per_device: int) -> dict:
    spec = rlinf_example(devices, prompts_per_device=prompts_per_device)
    flags = dataclasses.replace(spec, params=dataclasses.replace(
        spec.params, use_pre_process_policy=True, use_wait_before_last_iter_policy=True))
    out = {}
    for name, sp, pol in (("static", spec, "static"), ("rlinf", spec, "rlinf"),
                          ("rlinf_flags", flags, "rlinf"), ("tidal", spec, "tidal")):
        r = simulate(sp, pol, None, steps, seed=0, keep_events=False)
        out[name] = {"mean_step_s": r.mean_step_s, "idle_fraction": r.idle_fraction,
                     "sim_wall_s": r.sim_wall_s, "sim_wall_s_per_step": r.sim_wall_s / steps}
    for name in ("rlinf", "rlinf_flags", "tidal"):
        out[name]["speedup_vs_static"] = out["static"]["mean_step_s"] / out[name]["mean_step_s"]
    out["tidal"]["speedup_vs_rlinf"] = out["rlinf"]["mean_step_s"] / out["tidal"]["mean_step_s"]
    out["tidal"]["speedup_vs_rlinf_flags"] = out["rlinf_flags"]["mean_step_s"] / out["tidal"]["mean_step_s"]
    return {"devices": devices, "steps": steps, "prompts": spec.params.rollout_batch_size, "policies": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--steps", type=int, default=10, help="simulated steps on the 8-device example")
    ap.add_argument("--big-steps", type=int, default=3, help="simulated steps at 1,024 devices")
    ap.add_argument("--reps", type=int, default=300, help="decisions timed per (policy, size)")
    a = ap.parse_args()
    res = {"latency": {f"{pol}@{n}": latency(pol, n, a.reps) for pol in ("rlinf", "tidal") for n in (8, 64, 1024)},
           "sim_8": sim_figures(8, a.steps, 64), "sim_1024": sim_figures(1024, a.big_steps, 2)}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
