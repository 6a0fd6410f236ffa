"""Scheduler benchmark: policy decision latency, simulator speed, simulated step times.

    python benchmarks/scheduling.py --json benchmarks/results/scheduler/<date>_<commit7>_<machine>.json \
        [--steps 10] [--big-steps 100]

1. Decision latency of `rlinf` and `tidal` at 8, 64 and 1,024 devices, `time.perf_counter_ns` around each
   call (wall) and `time.thread_time_ns` (CPU of this thread: what preemption on a shared machine does not
   inflate), p50/p99/max over `--reps` calls each:
   - `captured`: every decision signal a simulation of that size produced (RLinf example shape; tidal's own
     run for tidal, rlinf's for rlinf), replayed with the producer's columns (what the simulator and a
     reconciler that builds `RolloutColumns` pass);
   - `records`: synthetic mid-step signals given as records only, so each call also builds the columns
     (the reconciler's plain path).
2. Simulated mean step time of static, rlinf under each flag combination and tidal on RLinf's 8-GPU example
   (1.5B, 512 prompts x 16, 4 iters, long tail), on the same shape at 1,024 devices with 2 prompts per device
   (`sim_1024`: latency-bound) and with the example's 64 prompts per device (`sim_1024_64ppd`), speedups vs
   static and vs each rlinf variant, idle fraction, simulator wall and CPU seconds.
3. Robustness: the 8-GPU example on workload seeds 1-3 (5 steps each): static, rlinf with both flags, tidal.
4. Simulator speed: 1,024 devices x `--big-steps` steps per policy (goal < 10 s on one core).
5. `table`: every baseline at its best against tidal's planned placement (`scheduler.plan_cli.report`) on the
   workloads users run (`scheduler.catalog`: gsm8k, math, longtail), model shapes 1.5B, 7B, 32B and clusters of
   8, 64 and 512 devices, costs measured on one H200 scaled to each shape; speedups of tidal over each baseline.
   `--table-only` runs just this part; `--quick`: the table's 8-device rows of 1.5B and 7B.

The JSON carries `name`, `date`, `machine` (host, CPU, cores, load average at start and end: on a shared machine
wall-clock tails are noisy; CPU times are the robust figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import random
import time
from pathlib import Path

from scheduler.catalog import CLUSTERS, MODELS, WORKLOADS, fits
from scheduler.catalog import spec as catalog_spec
from scheduler.costs import gpu_h200_1p5b
from scheduler.model_costs import shape
from scheduler.plan_cli import report
from scheduler.policies import get_policy
from scheduler.signals import ActorSignal, DeviceSignal, InferenceSignal, RolloutInstanceSignal, Signals
from scheduler.simulator import _Sim, simulate
from scheduler.state import SchedState
from scheduler.workload import SimSpec, rlinf_example
from tidal.core.devices import Owner
from tidal.core.provenance import commit

FLAGS = {"rlinf": (False, False), "rlinf_pre": (True, False), "rlinf_wait": (False, True),
         "rlinf_flags": (True, True)}


def spec_for(devices: int, pre: bool = False, wait: bool = False, ppd: int | None = None) -> SimSpec:
    spec = rlinf_example(devices, prompts_per_device=ppd or (64 if devices == 8 else 2))
    return dataclasses.replace(spec, params=dataclasses.replace(
        spec.params, use_pre_process_policy=pre, use_wait_before_last_iter_policy=wait))


def synthetic(devices: int, seed: int = 0) -> tuple[SchedState, Signals]:
    """Mid-step signals as records: every rollout instance busy, actor at a boundary."""
    spec = rlinf_example(devices, prompts_per_device=8)
    p = spec.params
    rng = random.Random(seed)
    rollout = []
    for d in p.rollout_devices:
        running = rng.randint(0, 400)
        rollout.append(RolloutInstanceSignal(d, (d,), rng.randint(0, 5), max(1, running // 16), running, 2048,
                                             rng.randint(0, 10**6), running * 900, 20_000.0 * rng.random(),
                                             running * 1500.0, est_tail_tokens=4000.0 * rng.random()))
    owners = [Owner.ACTOR] * devices
    for d in p.rollout_devices:
        owners[d] = Owner.ROLLOUT
    for d in p.inference_devices:
        owners[d] = Owner.INFERENCE
    sig = Signals(100.0, 0, tuple(rollout), InferenceSignal(p.inference_devices, 10, p.rollout_batch_size // 3, False),
                  ActorSignal(1, p.n_minibatches, True, p.initial_layout, 30.0), DeviceSignal(tuple(owners)),
                  p.rollout_batch_size, p.rollout_batch_size // 2, True, "boundary")
    return SchedState(p, gpu_h200_1p5b(), 1700.0, 256.0), sig


def _stats(ns: list[int]) -> dict:
    ns = sorted(ns)
    return {"p50_ms": ns[len(ns) // 2] / 1e6, "p99_ms": ns[min(len(ns) - 1, int(0.99 * len(ns)))] / 1e6,
            "max_ms": ns[-1] / 1e6, "n": len(ns)}


def _time_calls(fn, calls: list[tuple[SchedState, Signals]], reps: int) -> dict:
    wall, cpu = [], []
    k = 0
    while len(wall) < reps:
        st, sig = calls[k % len(calls)]
        k += 1
        sig = dataclasses.replace(sig)   # fresh object: no columns cached by an earlier call
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        fn(st, sig, sig.time)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
    return {"wall": _stats(wall), "cpu": _stats(cpu)}


def captured(policy: str, devices: int, steps: int) -> list[tuple[SchedState, Signals]]:
    """Every (state, signals) a simulation handed to `policy` (producer columns included)."""
    out: list[tuple[SchedState, Signals]] = []
    sim = _Sim(spec_for(devices), policy, 0, keep_events=False)
    inner = sim.decide

    def record(state, sig, now):
        out.append((state, sig))
        return inner(state, sig, now)
    sim.decide = record
    for s in range(steps):
        sim.run_step(s)
    return out


def latency(reps: int) -> dict:
    res = {}
    for pol in ("rlinf", "tidal"):
        fn = get_policy(pol)
        for n in (8, 64, 1024):
            calls = captured(pol, n, 2)
            res[f"{pol}@{n}"] = {"captured": _time_calls(fn, calls, reps),
                                 "records": _time_calls(fn, [synthetic(n)], reps),
                                 "decisions_captured": len(calls)}
    return res


def sim_figures(devices: int, steps: int, ppd: int | None = None) -> dict:
    out = {}
    runs = [("static", spec_for(devices, ppd=ppd), "static")]
    runs += [(name, spec_for(devices, *flags, ppd=ppd), "rlinf") for name, flags in FLAGS.items()]
    runs += [("tidal", spec_for(devices, ppd=ppd), "tidal")]
    for name, sp, pol in runs:
        c0 = time.process_time()
        r = simulate(sp, pol, None, steps, seed=0, keep_events=False)
        cpu = time.process_time() - c0
        out[name] = {"mean_step_s": r.mean_step_s, "idle_fraction": r.idle_fraction, "sim_wall_s": r.sim_wall_s,
                     "sim_cpu_s": cpu, "sim_cpu_s_per_step": cpu / steps,
                     "migrations": sum(s.migrations for s in r.steps), "reshards": sum(s.reshards for s in r.steps),
                     "decisions": sum(s.decisions for s in r.steps)}
    for name in out:
        out[name]["speedup_vs_static"] = out["static"]["mean_step_s"] / out[name]["mean_step_s"]
    out["tidal"]["speedup_vs"] = {k: out[k]["mean_step_s"] / out["tidal"]["mean_step_s"] for k in FLAGS}
    sp = spec_for(devices, ppd=ppd)
    return {"devices": devices, "steps": steps, "prompts": sp.params.rollout_batch_size,
            "group_size": sp.params.group_size, "n_minibatches": sp.params.n_minibatches, "policies": out}


def seeds_8(steps: int, seeds: tuple[int, ...] = (1, 2, 3)) -> dict:
    """The 8-GPU example on other workload seeds: static, rlinf with both flags (its best), tidal."""
    out = {}
    for seed in seeds:
        row = {name: simulate(sp, pol, None, steps, seed=seed, keep_events=False).mean_step_s
               for name, sp, pol in (("static", spec_for(8), "static"),
                                     ("rlinf_flags", spec_for(8, True, True), "rlinf"),
                                     ("tidal", spec_for(8), "tidal"))}
        row["tidal_vs_static"] = row["static"] / row["tidal"]
        row["tidal_vs_rlinf_flags"] = row["rlinf_flags"] / row["tidal"]
        out[str(seed)] = row
    return out


def sim_speed(steps: int) -> dict:
    out = {}
    for pol in ("static", "rlinf", "tidal"):
        c0, t0 = time.process_time(), time.perf_counter()
        r = simulate(spec_for(1024), pol, None, steps, seed=0, keep_events=False)
        out[pol] = {"steps": steps, "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0,
                    "mean_step_s": r.mean_step_s}
    return out


def table(steps: int, models: tuple[str, ...] = MODELS, clusters: tuple[int, ...] = CLUSTERS) -> dict:
    """Every (workload, model, cluster) of the catalog: each baseline at its best, tidal's plan, speedups."""
    rows, skipped = [], []
    for w in WORKLOADS:
        for m in models:
            for n in clusters:
                why = fits(shape(m), n)
                if why:
                    skipped.append({"workload": w, "model": m, "devices": n, "why": why})
                    continue
                c0 = time.process_time()
                rep = report(catalog_spec(w, m, n), steps)
                rep.update(workload=w, model=m, sim_cpu_s=time.process_time() - c0)
                rows.append(rep)
                a = rep["arms"]
                print(f"{w:9s} {m:5s} {n:4d}: " + "  ".join(f"{k} {v['step_s']:.1f}" for k, v in a.items())
                      + f"  tidal = {rep['plan']['chosen']}, {rep['tidal_vs_best_baseline']:.3f}x best; bound "
                      f"{rep['bound_s']:.1f} (collocated / bound {rep['collocated_over_bound']:.3f})", flush=True)
    worst = min(rows, key=lambda r: r["tidal_vs_best_baseline"])
    return {"steps": steps, "rows": rows, "skipped": skipped,
            "min_tidal_vs_best_baseline": worst["tidal_vs_best_baseline"],
            "max_collocated_over_bound": max(r["collocated_over_bound"] for r in rows),
            "tidal_vs": {k: {"min": min(r["arms"][k]["tidal_speedup"] for r in rows),
                             "max": max(r["arms"][k]["tidal_speedup"] for r in rows)}
                         for k in ("collocated", "hybrid", "static", "rlinf")}}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_start": os.getloadavg(), "note": "single-threaded runs"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--steps", type=int, default=10, help="simulated steps for the step-time figures")
    ap.add_argument("--big-steps", type=int, default=100, help="steps of the 1,024-device speed run")
    ap.add_argument("--wide-steps", type=int, default=3,
                    help="steps at 1,024 devices with the 8-GPU example's load per device (64 prompts each)")
    ap.add_argument("--reps", type=int, default=2000, help="decisions timed per (policy, size, kind)")
    ap.add_argument("--table-steps", type=int, default=3, help="simulated steps per arm of the baselines table")
    ap.add_argument("--table-only", action="store_true", help="only the baselines table (part 5)")
    ap.add_argument("--quick", action="store_true", help="only the table's 8-device rows of 1.5B and 7B")
    a = ap.parse_args()
    m = machine()
    if a.quick or a.table_only:
        res = {"name": "scheduler", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "commit": commit(), "machine": m,
               "command": "python benchmarks/scheduling.py " + ("--quick" if a.quick else "--table-only"),
               "table": table(a.table_steps, *((("1.5b", "7b"), (8,)) if a.quick else ()))}
        m["load_avg_end"] = os.getloadavg()
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
        return
    res = {"name": "scheduler", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": commit(), "machine": m, "latency": latency(a.reps), "sim_8": sim_figures(8, a.steps),
           "sim_8_seeds": seeds_8(5), "sim_1024": sim_figures(1024, a.steps),
           "sim_1024_64ppd": sim_figures(1024, a.wide_steps, ppd=64),
           "sim_speed_1024": sim_speed(a.big_steps), "table": table(a.table_steps)}
    m["load_avg_end"] = os.getloadavg()
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "latency"}, indent=1))
    for k, v in res["latency"].items():
        print(k, "captured wall p50/p99 {:.3f}/{:.3f} ms cpu p99 {:.3f}; records wall p50/p99 {:.3f}/{:.3f}".format(
            v["captured"]["wall"]["p50_ms"], v["captured"]["wall"]["p99_ms"], v["captured"]["cpu"]["p99_ms"],
            v["records"]["wall"]["p50_ms"], v["records"]["wall"]["p99_ms"]))


if __name__ == "__main__":
    main()
