"""End-to-end scheduling benchmark: the same RL workload and seeds under `static`, `collocated`, `rlinf` and `tidal`
on 8 devices (CPU virtual devices with fixed compute shares, or 8 GPUs), plus the simulator's figures for RLinf's
example.

    python benchmarks/e2e.py --quick --json benchmarks/results/e2e/<date>_<commit7>_<machine>.json
    python benchmarks/e2e.py --quick --model tiny --json /tmp/e2e.json            # a Hugging Face checkpoint, CPU
    python benchmarks/e2e.py --smoke --json /tmp/e2e.json                         # the test suite's smoke run
    python benchmarks/e2e.py --device cuda --model qwen2.5-1.5b --max-new-tokens 4096 --prompts 64 \
        --max-running 256 --json PATH                                               # 8 GPUs
    python benchmarks/e2e.py --device cuda --devices 1 --policies collocated --model qwen2.5-1.5b --quick \
        --no-sim --json PATH                                                        # a dry run on one GPU

Every run trains on the parity reward (tests/parity_reward.py: about half of every group rewarded), since a random
model earns no task reward and its steps would train nothing.
`--model` other than `own`: a random Qwen2 checkpoint of that shape written by transformers, loaded through
`model.path`, GSM8K-format data files, response lengths geometric with
mean ~300 capped at `--max-new-tokens` (`benchmarks/hf_inputs.py`). The CPU cost-model calibration and its
predictions run with `own` on CPU only (the preset they refit is that workload's).

Real part (one `tidal.pipeline.run.TrainingRun` per policy, same config and seeds, all opened first; then step k
of each runs back to back, rotating who goes first every round, so the machine's drift over minutes lands on
every policy alike. `paired_speedup_vs_static` is the median of the per-step ratios, with their range):

    placement   RLinf's: actor 0-1 (TP 1, DP 2), rollout 2-5 (4 instances), inference 6-7; `collocated`:
                every component on 0-7 (verl's default mode), each step generating on 8 instances, then scoring
                on 8, then training at DP 8, in turn (no offload: CPU memory is not what it saves)
    compute     cluster.cpu_device_cores "1" (every core but core 0) and cpu_compute_share 0.125 of it: the 8
                devices share one core's time by quota (0.125 core each), the driver and Ray run on core 0.
                An idle device's capacity is lost, as on a GPU, and a busy device's speed does not depend on
                its neighbours (on a 2-core VM whose vCPUs share a host core, two busy vCPUs do about one's work:
                benchmarks/share.py)
    workload    addition task from the random init (warm_start.iters 0): eos is sampled with probability
                ~1/vocab per token, so response lengths are geometric (mean ~19 tokens) capped at
                max_new_tokens: a natural long tail (a group ends with its longest sample)
    actor       n_minibatches 4, a model whose iter on the 2 capped actor devices takes about as long as
                rollout's tail, so both sides of the trade matter

Per-step wall time excludes step 0 (worker warm-up: first allocations, process-group creation, first reshard
plans); the JSON keeps every step. Each run's folder holds `events.json` (every decision, action, reshard and
migration with its seconds), `timeline.png` and `summary.json`.

Simulator part: `scheduler.simulator.simulate` on `rlinf_example()` (1.5B, 8 GPUs, 512 prompts x 16,
4 iters, long tail) and on 1,024 devices (same shape, 2 prompts per device), static / rlinf / tidal.

Calibration: from the static run's measurements (per rollout slice: batch and seconds per decode step; actor
iter seconds per dp from every run; reshard seconds and bytes) the script fits the CPU cost model with
`scheduler.costs.fit_linear` / `fit_decode` / `fit_actor` and reports the fitted values next to the
preset the policy used (`scheduler.costs_cpu.cpu_e2e`); see docs/e2e.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scheduler import from_run
from scheduler.costs import preset
from tidal.core.placement import parse_device_ids
from tidal.core.provenance import commit

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/: the shared inputs
import hf_inputs

QUICK = dict(steps=3, prompts=32, group_size=8, max_new_tokens=48, hidden=128, layers=4, intermediate=384)
#: `--smoke`: --quick's code path at toy sizes (2 steps: step 0 is left out of the figures, step 1 is measured)
SMOKE = dict(steps=2, prompts=8, group_size=4, max_new_tokens=16, hidden=64, layers=2, intermediate=128)
#: `--smoke`'s other defaults: two policies, uncapped devices (a capped device imports torch at 1/8 of a core),
#: no calibration
SMOKE_ARGS = dict(policies="static,tidal", share=1.0, device_cores="all", calibrate=False)
#: the labels that run the static policy: disaggregated, and every component on all 8 devices
STATIC = ("static", "collocated")
MICRO_BATCH = 8   # sequences per actor micro-batch: an iter of 64 sequences is 8 of them
#: GPU: actor micro-batches by token budget (sorted by length, little padding), as the collocated benchmark trains;
#: 8 sequences of geometric lengths padded to their longest train ~2.5x their tokens (the longest of 8 is ~2.7 means)
GPU_MICRO_BATCH_TOKENS = 16384
FULL = dict(steps=5, prompts=32, group_size=8, max_new_tokens=48, hidden=128, layers=4, intermediate=384)


def parse_variant(label: str) -> tuple[str, dict[str, str]]:
    """`tidal+grow_on_return=true+margin_s=0` -> ("tidal", {"grow_on_return": "true", "margin_s": "0"}): a
    policy with `scheduler.*` keys overridden, run side by side with the plain ones (config validation checks
    the keys and values). A dotted key names another section: `static+rollout.slices_ahead=1`."""
    policy, *sets = label.split("+")
    over = {}
    for kv in sets:
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise SystemExit(f"--policies: {kv!r} in {label!r} is not KEY=VALUE (a scheduler.* key, or "
                             "SECTION.KEY), e.g. tidal+grow_on_return=true or tidal+rollout.slices_ahead=1")
        over[k] = v
    return policy, over


def build(label: str, a: argparse.Namespace, out: Path):
    from tidal.core.config import build_config
    policy, over = parse_variant(label)
    static = policy in STATIC
    n = getattr(a, "devices", 8)
    placement = {"actor,rollout,inference": f"0-{n - 1}" if n > 1 else "0"} if policy == "collocated" else \
        {"actor": "0-1", "rollout": "2-5", "inference": "6-7"}
    sections = {k: v for k, v in over.items() if "." in k}
    over = {k: v for k, v in over.items() if "." not in k}
    name = "e2e-" + label.replace("+", "_").replace("=", "-")
    device = getattr(a, "device", "cpu")
    cluster = {"num_devices_per_node": n, "device": device, "component_placement": placement,
               "auto_scheduler": not static}
    if device == "cpu":
        cluster.update(cpu_compute_share=a.share, cpu_share_period_ms=a.share_period_ms,
                       cpu_device_cores=a.device_cores)
    rollout = {"max_new_tokens": a.max_new_tokens, "max_running_requests": a.max_running}
    if device == "cuda":
        rollout["gpu_memory_utilization"] = a.gpu_memory_utilization
    inputs = getattr(a, "inputs", None)   # an HF checkpoint and GSM8K-format files (`--model`), else the task's
    raw = {
        "run": {"name": name, "num_steps": a.steps, "seed": a.seed, "output_dir": str(out),
                "eval_every": 10_000},
        "cluster": cluster,
        "scheduler": {"policy": policy if not static else "tidal", **over},
        "actor": {"micro_batch_size": MICRO_BATCH, "lr": 1e-4 if inputs is None else 1e-6, "warmup_iters": 0,
                  **({"max_tokens_per_micro_batch": max(GPU_MICRO_BATCH_TOKENS, 64 + a.max_new_tokens)}
                     if device == "cuda" else {})},
        "rollout": rollout,
        "algorithm": {"group_size": a.group_size, "n_minibatches": 4},
        "data": {"rollout_batch_size": a.prompts, "eval_size": 8, "seed": a.seed},
        "warm_start": {"iters": 0},
        # a random model earns no task reward: every group would have zero advantage and no step would train
        "reward": {"function": hf_inputs.PARITY_REWARD},
    }
    if inputs is None:
        raw["model"] = {"hidden_size": a.hidden, "num_layers": a.layers, "num_heads": 4, "num_kv_heads": 2,
                        "intermediate_size": a.intermediate,
                        "max_seq_len": 16 + a.max_new_tokens}   # 9-token prompts + the response cap, rounded up
    else:
        ckpt, train, val = inputs
        raw["model"] = {"path": str(ckpt)}
        raw["data"].update(train_files=[str(train)], val_files=[str(val)], prompt_key="question",
                           max_prompt_length=32)
    for key, v in sections.items():
        sec, _, k = key.partition(".")
        raw.setdefault(sec, {})[k] = v
    return build_config(raw, [])


class PolicyRun:
    """One policy's `TrainingRun`, opened once and stepped on demand, so the policies' steps can interleave."""

    def __init__(self, policy: str, a: argparse.Namespace, out: Path):
        from tidal.pipeline.run import TrainingRun
        self.policy, self.a = policy, a
        self.cfg = build(policy, a, out)
        self.run = TrainingRun(self.cfg, out / self.cfg.run.name)
        self.steps: list[dict] = []
        t0 = time.monotonic()
        self.run.open()
        self.open_s = time.monotonic() - t0

    def step(self) -> dict:
        run = self.run
        m = run.step()
        res = run._res
        ev = res.events
        s = {"step": len(self.steps), "seconds": res.seconds, "idle_fraction": m["step/idle_fraction"],
             "phase_seconds": res.phase_seconds,
             "reshards": sum(e["kind"] == "reshard" for e in ev),
             "migrations": sum(e["kind"] == "migration" for e in ev),
             "actions": sum(e["kind"] == "action" for e in ev),
             "failed_actions": sum(e["kind"] == "action" and not e["ok"] for e in ev),
             # seconds the driver spent applying the policy's actions (it hands out no work meanwhile)
             "action_s": sum(e.get("seconds", 0.0) for e in ev if e["kind"] == "action"),
             "reward_mean": m.get("grpo/reward_mean", 0.0),
             "response_len_mean": m.get("grpo/response_tokens_mean", 0.0),
             # the devices' own speed in this step: median seconds per engine pump inside the rollout instances
             "pump_s": m.get("rollout/pump_s_median", 0.0),
             # rollout instances holding work: seconds generating, in call overhead, and with no call to run
             "rollout_busy_s": m.get("rollout/busy_instance_s", 0.0),
             "rollout_call_overhead_s": m.get("rollout/call_overhead_instance_s", 0.0),
             "rollout_gap_s": m.get("rollout/gap_instance_s", 0.0),
             # garbage-collector pauses: the driver's (sum, longest) and the rollout instances' (sum)
             "driver_gc_s": m.get("driver/gc_s", 0.0), "driver_gc_max_s": m.get("driver/gc_max_s", 0.0),
             "rollout_gc_s": m.get("rollout/gc_instance_s", 0.0)}
        s["pumps"] = s["seconds"] / s["pump_s"] if s["pump_s"] else 0.0   # step time in pumps: drift removed
        self.steps.append(s)
        print(f"  [{self.policy}] step {s['step']}: {res.seconds:.2f}s idle {s['idle_fraction']:.2f} "
              f"reshards {s['reshards']} migrations {s['migrations']} failed {s['failed_actions']}", flush=True)
        return s

    def finish(self) -> dict:
        """Write the run's records, measure the cost-model samples (static only), and return its result."""
        run, cfg, steps = self.run, self.cfg, self.steps
        summary = run.finish()
        events = list(run.pipe.cluster.events)
        timeline = run.pipe.timeline
        calib = {}
        if self.a.calibrate and self.policy == "static":  # on an idle rollout device of the same capped group
            fn = "tidal.workers.cost_probes:"
            calib["decode"] = run.group.call(2, fn + "measure_decode", batches=[1, 8, 16, 32, 64])
            calib["prefill_per_token_s"] = run.group.call(2, fn + "measure_prefill")
            print(f"  [static] decode (batch, s/step): {calib['decode']}; prefill "
                  f"{calib['prefill_per_token_s'] * 1e3:.2f} ms/token", flush=True)
            calib["actor_iters"] = actor_iters(run, cfg)
            print(f"  [static] actor iter (dp, driver s, worker s): {calib['actor_iters']}", flush=True)
        measured = steps[1:] or steps
        # the cost model the policy predicts with, held against this run step by step (`tidal plan --from-run
        # DIR --learned`: each step from its own lengths and what the run learned by the step before)
        rec = from_run.load(summary.output_dir)
        pred = from_run.predict(rec, preset("cpu" if rec.device_kind == "cpu" else "gpu_h200"), learn=True)
        mean = sum(s["seconds"] for s in measured) / len(measured)
        idle = sum(s["idle_fraction"] * s["seconds"] for s in measured) / sum(s["seconds"] for s in measured)
        return {"policy": self.policy, "step_s": mean, "idle_fraction": idle, "open_s": self.open_s,
                "reshards": sum(s["reshards"] for s in measured),
                "migrations": sum(s["migrations"] for s in measured),
                "failed_actions": sum(s["failed_actions"] for s in measured),
                "action_s": sum(s["action_s"] for s in measured) / len(measured), "steps": steps,
                "final_weights_sha": summary.final_weights_sha, "output_dir": summary.output_dir,
                "calibration": calib, "from_run": pred, "_events": events, "_timeline": timeline}

    def close(self) -> None:
        self.run.close()


def interleave(policies: list[str], a: argparse.Namespace, out: Path, pinned: set[int]) -> tuple[dict, list]:
    """Open every policy's run, then play step k of each in turn, rotating who goes first each round, so
    the machine's drift over minutes lands on every policy alike (paired steps). Returns the results and
    one core-speed probe per round (drift indicator)."""
    runs: list[PolicyRun] = []
    speeds = []
    try:
        for pol in policies:
            runs.append(PolicyRun(pol, a, out))
        cpu = getattr(a, "device", "cpu") == "cpu"   # a GPU's speed does not drift with its neighbours' load
        for k in range(a.steps):
            speeds.append({"step": k, "before": core_speed(pinned) if cpu else None})
            for r in runs[k % len(runs):] + runs[:k % len(runs)]:
                r.step()
        speeds.append({"step": a.steps, "before": core_speed(pinned) if cpu else None})
        return {r.policy: r.finish() for r in runs}, speeds
    finally:
        for r in reversed(runs):  # the first group started the embedded Ray: it goes last
            r.close()


def actor_iters(run, cfg, reps: int = 2) -> list[tuple[int, float, float]]:
    """After the run (its workers idle): one iter's samples trained at dp 2, 4, 6, 8 on the same capped
    devices, `reps` times each: (dp, seconds seen by the driver, seconds inside the worker). The actor moves
    with plain reshard calls (the run is over: its ledger is not consulted)."""
    import ray

    from tidal.engine.grpo import count_response_tokens, flatten_groups
    from tidal.engine.layout import Layout
    from tidal.workers import roles
    g, st = run.group, run.pipe.step_state
    n = cfg.sequences_per_iter
    samples = flatten_groups([st.scored[i] for i in sorted(st.scored)])[:n]
    ref, tokens = ray.put(samples), count_response_tokens(samples)
    out = []
    for dp in (2, 4, 6, 8):
        lay = Layout(1, dp, tuple(range(dp)))
        g.gather(g.submit_all(roles.actor_reshard, layout=lay))
        for _ in range(reps):
            t0 = time.monotonic()
            res = g.gather([g.submit(d, roles.actor_train_iter, samples=ref, num_tokens=tokens)
                            for d in lay.devices])
            out.append((dp, time.monotonic() - t0, max(r["actor/iter_s"] for r in res if r)))
    return out


def machine() -> dict:
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_start": os.getloadavg()}


def sim_figures(steps_8: int, steps_1024: int, cfg=None) -> dict:
    """Simulated static / rlinf / tidal on RLinf's example (8 devices) and at 1,024 devices (2 prompts each); with
    `cfg`, also on this benchmark's own workload with the CPU cost model (`cpu_e2e()`, fitted to this setup):
    what the policy code would reach if the workers behaved as modelled (3 seeds, 3 steps each)."""
    from dataclasses import replace

    from scheduler.costs_cpu import cpu_e2e
    from scheduler.simulator import simulate
    from scheduler.workload import LengthDist, SimSpec, rlinf_example
    out = {}
    cases = [("rlinf_example_8", 8, rlinf_example(8, prompts_per_device=64), steps_8, (0,)),
             ("devices_1024", 1024, rlinf_example(1024, prompts_per_device=2), steps_1024, (0,))]
    if cfg is not None:   # geometric lengths of mean ~19.5 (median ~13), uncorrelated within a group: lognormal fit
        spec = replace(SimSpec.from_config(cfg), costs=cpu_e2e(), prompt_tokens=9,
                       lengths=LengthDist(median=13.0, sigma=0.9, group_sigma=0.0))
        cases.append(("cpu_e2e_workload", 8, spec, 3, (0, 1, 2)))
    for key, devices, spec, steps, seeds in cases:
        res = {}
        for pol in ("static", "rlinf", "tidal"):
            rs = [simulate(spec, pol, None, steps, seed=sd, keep_events=False) for sd in seeds]
            res[pol] = {"mean_step_s": sum(r.mean_step_s for r in rs) / len(rs),
                        "idle_fraction": sum(r.idle_fraction for r in rs) / len(rs),
                        "reshards": sum(x.reshards for r in rs for x in r.steps),
                        "migrations": sum(x.migrations for r in rs for x in r.steps),
                        "sim_wall_s": sum(r.sim_wall_s for r in rs)}
        out[key] = {"devices": devices, "prompts": spec.params.rollout_batch_size, "group_size": spec.params.group_size,
                    "n_minibatches": spec.params.n_minibatches, "steps": steps, "seeds": list(seeds), "policies": res,
                    "tidal_speedup_vs_static": res["static"]["mean_step_s"] / res["tidal"]["mean_step_s"],
                    "tidal_speedup_vs_rlinf": res["rlinf"]["mean_step_s"] / res["tidal"]["mean_step_s"]}
    return out


def score_group_s(static_steps: list[dict], groups: int) -> float:
    """Seconds inference spends per scored group in the static run (its devices score nothing else): the
    inference phase's device-seconds of steps >= 1 over the groups scored."""
    steps = static_steps[1:] or static_steps
    busy = [s.get("phase_seconds", {}).get("inference", 0.0) for s in steps]
    return sum(busy) / (len(busy) * groups) if busy and groups else 0.0


def fit(runs: dict, cfg_tokens: float, micro_batches: int, groups: int = 0, group_tokens: float = 0.0):
    """The CPU cost model fitted from this benchmark's measurements (see scheduler/costs_cpu.py): (the record
    for the JSON, the fitted `CostModel` or None when the static run was not calibrated)."""
    from dataclasses import asdict

    from scheduler.costs_cpu import calibrate, cpu_e2e, event_costs, iter_samples
    static = runs.get("static", {})
    cal = static.get("calibration") or {}
    if not cal.get("decode"):
        return {}, None
    iters = [(dp, s) for dp, s, _ in cal.get("actor_iters", [])]
    moves: dict[str, list[float]] = {}
    for r in runs.values():
        for k, v in event_costs(r["_events"]).items():
            moves.setdefault(k, []).extend(v)
        iters += [] if cal.get("actor_iters") else iter_samples(r["_timeline"])
    score_s = score_group_s(static.get("steps", []), groups)
    fitted = calibrate(cpu_e2e(), cal["decode"], cal["prefill_per_token_s"], iters, cfg_tokens, moves,
                       micro_batches, score_s, group_tokens)

    def pick(c):
        return {"decode": asdict(c.decode), "actor": {k: v for k, v in asdict(c.actor).items()
                                                      if k in ("train_per_token_s", "iter_fixed_s")},
                "inference": asdict(c.inference),
                "reshard_fixed_s": c.reshard.fixed_s, "kv_fixed_s": c.kv_fixed_s, "lend_s": c.lend_s}

    return ({"samples": {"decode": cal["decode"], "prefill_per_token_s": cal["prefill_per_token_s"],
                         "actor_iters_dp_s": iters, "iter_tokens": cfg_tokens, "score_group_s": score_s,
                         "group_tokens": group_tokens, "moves": {k: sorted(v) for k, v in moves.items()}},
             "fitted": pick(fitted), "preset_cpu_e2e": pick(cpu_e2e())}, fitted)


def predicted(costs, labels: list[str], a: argparse.Namespace, out: Path, measured: dict[str, float],
              seeds: tuple[int, ...] = (0, 1, 2), steps: int = 3) -> dict:
    """The simulator on this run's workload with the costs fitted from this run, per policy (variants too),
    next to the measured step time: how far the policy's own model of the machine is from what happened.
    Lengths: the geometric response lengths (mean ~19.5, capped at max_new_tokens) as a lognormal of the
    same median, uncorrelated within a group. The policy is asked as often as the driver asks it (`MIN_INTERVAL_S`)."""
    from dataclasses import replace

    from scheduler.simulator import simulate
    from scheduler.workload import LengthDist, SimSpec
    from tidal.pipeline.control import MIN_INTERVAL_S
    res = {}
    for label in labels:
        policy, _ = parse_variant(label)
        if policy == "collocated":   # the simulator models disaggregated placements only
            continue
        spec = replace(SimSpec.from_config(build(label, a, out)), costs=costs, prompt_tokens=9,
                       lengths=LengthDist(median=13.0, sigma=0.9, group_sigma=0.0), poll_s=MIN_INTERVAL_S)
        sim = [simulate(spec, policy, None, steps, seed=sd, keep_events=False).mean_step_s for sd in seeds]
        res[label] = {"simulated_step_s": sum(sim) / len(sim), "measured_step_s": measured[label],
                      "measured_over_simulated": measured[label] / (sum(sim) / len(sim))}
    return res


def group_creation_s(events: list[dict], step: int) -> float:
    """Seconds of a step's reshards spent outside the workers' reshard (first use of a layout creates its
    process groups, collective over the world: seconds on capped workers, once per layout per run)."""
    return sum(max(0.0, e["seconds"] - e.get("worker_s", e["seconds"])) for e in events
               if e["kind"] == "reshard" and e.get("step") == step)


def event_summary(events: list[dict], steps: int) -> dict:
    """Where a policy's driver time and actor iters went, over the measured steps (>= 1): per action kind its
    count and seconds per step; per actor data-parallel size the median iter and its phases (slowest rank); the
    median migration wave and reshard with their phases (driver side and workers'); when iter 0's mini-batch was
    generated and scored and when iter 0 started (seconds from the step's start, medians); the median weight sync
    and how many engines loaded a kept copy (local) or the gathered weights (remote)."""
    n = max(1, steps - 1)
    acts: dict[str, list[float]] = {}
    iters: dict[int, list[dict]] = {}
    waves: dict[float, dict] = {}   # a wave records one migration event per move, all at one time
    reshards: list[dict] = []
    first: list[dict] = []   # iter 0 of each step: when its mini-batch was generated, scored, and it started
    syncs: list[dict] = []
    for e in events:
        if e.get("step", 0) < 1:
            continue
        if e["kind"] == "action":
            acts.setdefault(e["action"], []).append(e["seconds"])
        elif e["kind"] == "iter":
            iters.setdefault(e["dp"], []).append(e)
            if e.get("iter") == 0 and "at_s" in e:
                first.append(e["at_s"])
        elif e["kind"] == "weight_sync" and "seconds" in e:
            syncs.append({"seconds": e["seconds"], "local": len(e.get("local", ())),
                          "remote": len(e.get("remote", ()))})
        elif e["kind"] == "migration":
            waves[e["time"]] = {"seconds": e["seconds"], "moves": e.get("wave", 1), **e.get("phases_s", {})}
        elif e["kind"] == "reshard":
            reshards.append({"seconds": e["seconds"], "worker_s": e.get("worker_s", 0.0),
                             "idle_s": e.get("idle_s", 0.0), "prepare_s": e.get("prepare_s", 0.0),
                             "call_s": e.get("call_s", 0.0), "gc_s": e.get("gc_s", 0.0),
                             **e.get("phases_s", {})})

    def medians(rows: list[dict]) -> dict:
        keys = sorted({k for r in rows for k in r})
        return {"count": len(rows), **{k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}} if rows \
            else {"count": 0}
    out = {"actions": {k: {"per_step": len(v) / n, "seconds_per_step": sum(v) / n,
                           "median_s": statistics.median(v)} for k, v in sorted(acts.items())},
           "iters": {}, "migration_waves": medians(list(waves.values())), "reshards": medians(reshards),
           "first_iter_at_s": medians(first), "weight_syncs": medians(syncs)}
    for dp, es in sorted(iters.items()):
        phases = sorted({p for x in es for p in x.get("phases_s", {})})
        out["iters"][dp] = {"count": len(es), "median_s": statistics.median(x["seconds"] for x in es),
                            **{f"{p}_s": statistics.median(x["phases_s"].get(p, 0.0) for x in es) for p in phases}}
    return out


SPEED_PROBE = """
import os
os.sched_setaffinity(0, {cores})
from tidal.workers.probes import forwards_per_second, probe_model
model = probe_model()
forwards_per_second(model, 0.2)
print(forwards_per_second(model, {seconds}))
"""


def core_speed(cores: set[int] | None, seconds: float = 2.0) -> float:
    """Forwards/s of the e2e model on the devices' cores, uncapped, nothing else running there (between runs).

    A drift indicator, not a correction: a shared machine's cores change speed by the minute (other tenants on
    the host; measured 17-84 forwards/s around one run on a 2-core machine), which is why the policies' steps
    interleave. Recorded at
    the start of every round."""
    cores = cores or set(range(os.cpu_count() or 1))
    out = subprocess.run([sys.executable, "-c", SPEED_PROBE.format(cores=sorted(cores), seconds=seconds)],
                         capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def paired(base: list[dict], new: list[dict], key: str = "seconds") -> dict:
    """Per-step ratios base / new of `key` over the measured steps (>= 1; step k of both ran back to back),
    median and range. On "seconds" the drift slower than one round cancels; on "pumps" (step time over the
    step's own median engine-pump time) the drift within a round does too, as long as it slows every device
    alike (they share one core)."""
    r = sorted(b[key] / n[key] for b, n in zip(base[1:], new[1:]) if b.get(key) and n.get(key))
    return {"median": statistics.median(r), "min": r[0], "max": r[-1], "ratios": r} if r else {}


def table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    c = res["config"]
    t = Table(title=f"e2e on {c.get('devices', 8)} GPU(s)" if c.get("device") == "cuda" else
              f"e2e on 8 CPU virtual devices, each capped at {c['cores_per_device']:.2f} core "
              f"(cluster.cpu_compute_share {c['cpu_compute_share']})")
    for col in ("policy", "step s (steps>=1)", "vs static", "vs collocated", "paired vs static (median, range)",
                "in pumps (median, range)", "idle", "reshards", "migrations", "failed actions",
                "actions s/step"):
        t.add_column(col)
    runs = res["runs"]
    st, co = runs.get("static"), runs.get("collocated")
    for k, v in runs.items():
        pr = paired(st["steps"], v["steps"]) if st else {}
        pp = paired(st["steps"], v["steps"], "pumps") if st else {}
        t.add_row(k, f"{v['step_s']:.2f}", f"{st['step_s'] / v['step_s']:.2f}x" if st else "-",
                  f"{co['step_s'] / v['step_s']:.2f}x" if co else "-",
                  f"{pr['median']:.2f}x ({pr['min']:.2f}-{pr['max']:.2f})" if pr else "-",
                  f"{pp['median']:.2f}x ({pp['min']:.2f}-{pp['max']:.2f})" if pp else "-",
                  f"{v['idle_fraction']:.2f}", str(v["reshards"]), str(v["migrations"]), str(v["failed_actions"]),
                  f"{v.get('action_s', 0.0):.2f}")
    Console().print(t)
    for k, v in runs.items():   # the critical path's first segment, and the step's end
        f, w = v.get("event_summary", {}).get("first_iter_at_s", {}), v.get("event_summary", {}).get("weight_syncs", {})
        if f.get("count"):
            print(f"{k}: iter 0's mini-batch generated {f['generated']:.2f} s, scored {f['scored']:.2f} s, iter 0 "
                  f"started {f['started']:.2f} s into the step (medians); weight sync {w.get('seconds', 0.0):.3f} s "
                  f"({w.get('local', 0):.0f} engines from kept copies, {w.get('remote', 0):.0f} gathered)")
    if any(p["before"] is not None for p in res.get("core_speed", [])):
        print("core speed (forwards/s of the e2e model on the devices' cores, uncapped, at each round's start: the "
              "machine's drift): " + ", ".join(f"{p['before']:.0f}" for p in res["core_speed"]))
    pred = res.get("fitted_prediction")
    if pred:
        t = Table(title="measured vs simulated with the costs fitted in this run (scheduler/costs_cpu.py)")
        for col in ("policy", "measured s/step", "simulated s/step", "measured / simulated"):
            t.add_column(col)
        for label, v in pred.items():
            t.add_row(label, f"{v['measured_step_s']:.2f}", f"{v['simulated_step_s']:.2f}",
                      f"{v['measured_over_simulated']:.2f}")
        Console().print(t)
    for key, sim in res.get("simulator", {}).items():
        t = Table(title=f"simulator {key}: {sim['devices']} devices, {sim['prompts']} prompts x {sim['group_size']}")
        for col in ("policy", "mean step s", "vs static", "idle"):
            t.add_column(col)
        base = sim["policies"]["static"]["mean_step_s"]
        for pol, v in sim["policies"].items():
            t.add_row(pol, f"{v['mean_step_s']:.1f}", f"{base / v['mean_step_s']:.2f}x", f"{v['idle_fraction']:.2f}")
        Console().print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--quick", action="store_true", help="3 steps per policy (< 10 min on 2 cores)")
    ap.add_argument("--smoke", action="store_true",
                    help="a smoke run of --quick's code path, its figures meaningless: 2 steps of 8 prompts x 4, "
                         "a 2-layer 64-wide model, --policies static,tidal, --share 1 --device-cores all, "
                         "--no-calibrate (flags given explicitly win); about a minute on 2 cores")
    ap.add_argument("--policies", default="static,collocated,rlinf,tidal",
                    help="comma-separated: static, collocated (static, every component on 0-7), rlinf, tidal; a "
                         "variant overrides scheduler.* keys: tidal+grow_on_return=true")
    ap.add_argument("--out", default="runs/e2e", help="run folders (events.json, timeline.png) go here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--share", type=float, default=0.125,
                    help="cluster.cpu_compute_share per device (a fraction of the device cores)")
    ap.add_argument("--share-period-ms", type=float, default=50.0,
                    help="cluster.cpu_share_period_ms: the CFS period of the cap (docs/e2e.md)")
    ap.add_argument("--device-cores", default="auto",
                    help='cluster.cpu_device_cores: the cores the 8 devices are pinned to; the driver and Ray run '
                         'on the others. auto: every core but core 0 (on 2 cores: "1"); "all": no pinning. '
                         "Why: on a VM whose vCPUs share a host core a device slows down when the others are "
                         "busy unless all devices share one core's time (benchmarks/share.py, docs/e2e.md)")
    ap.add_argument("--max-running", type=int, default=16,
                    help="rollout.max_running_requests: 16 gives 4 waves of 64 sequences per instance, RLinf's "
                         "example ratio (2,048 sequences per instance at 512 slots); 64 runs every sequence at "
                         "once (latency-bound: no policy can gain much, see docs/e2e.md)")
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="skip the decode / actor measurements on the capped workers after the static run")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cluster.device: cpu (8 virtual devices with capped shares), cuda (8 GPUs)")
    ap.add_argument("--devices", type=int, default=8,
                    help="devices of the cluster: 8 (RLinf's placement); fewer runs `collocated` only (every "
                         "component on all of them), e.g. 1 for a dry run on one GPU")
    ap.add_argument("--model", choices=("own", *hf_inputs.MODELS), default="own",
                    help="own: Tidal's model from random init on the built-in addition task (--hidden, --layers, "
                         "--intermediate); otherwise a random Hugging Face checkpoint of that shape loaded through "
                         "model.path, GSM8K-format data files and the parity reward (benchmarks/hf_inputs.py: "
                         "response lengths geometric with mean ~300, capped at --max-new-tokens)")
    ap.add_argument("--work", default="runs/e2e-inputs", help="the checkpoint and data files of --model")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8,
                    help="rollout.gpu_memory_utilization (cuda)")
    for k in QUICK:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None)
    a = ap.parse_args(argv)
    if a.smoke:   # its defaults under the flags given explicitly
        ap.set_defaults(**SMOKE_ARGS)
        a = ap.parse_args(argv)
    if not 1 <= a.devices <= 8 or (a.devices < 8 and a.policies != "collocated"):
        ap.error(f"--devices {a.devices}: 8 runs every policy; 1..7 run --policies collocated only (RLinf's "
                 "placement needs devices 0-7)")
    hf_inputs.importable_from_root()   # the parity reward's module, on the workers' path too
    if a.model != "own":
        a.inputs = hf_inputs.make_inputs(Path(a.work) / a.model, hf_inputs.MODELS[a.model])
    if a.model != "own" or a.device == "cuda":
        a.calibrate = False   # the CPU cost model (scheduler/costs_cpu.py) is fitted to the own model's workload
    base = SMOKE if a.smoke else QUICK if a.quick else FULL
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    out = Path(a.out)
    t0 = time.monotonic()
    n_cpu = os.cpu_count() or 1
    if a.device_cores == "auto" and a.device == "cpu":
        a.device_cores = None if n_cpu < 2 else ("1" if n_cpu == 2 else f"1-{n_cpu - 1}")
    elif a.device_cores in ("all", "auto"):
        a.device_cores = None
    pinned = set(parse_device_ids(a.device_cores, "--device-cores")) if a.device_cores else set()
    if pinned and len(pinned) < n_cpu:  # the driver, and the Ray processes it starts, off the devices' cores
        os.sched_setaffinity(0, set(range(n_cpu)) - pinned)
    cores = a.share * (len(pinned) or n_cpu)
    res = {"name": "e2e", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": commit(), "machine": machine(),
           "config": {"cpu_compute_share": a.share, "cores_per_device": cores,
                      "cpu_share_period_ms": a.share_period_ms,
                      "cpu_device_cores": a.device_cores or "all",
                      "note": f"devices on cores {a.device_cores or 'all'} of {n_cpu}, each capped at {cores:.3f} "
                              "core (cgroup CPU quota); driver and Ray on the other cores" if a.device == "cpu"
                      else "one GPU a device",
                      "placement": "actor 0-1 (tp1 dp2), rollout 2-5, inference 6-7; collocated: all on 0-7 "
                                   "(tp1 dp8, 8 rollout instances, 8 scorers, in turn)" if a.devices == 8 else
                      f"collocated on {a.devices} device(s)", "devices": a.devices, "steps": a.steps,
                      "step_time": "mean over steps >= 1 (step 0: warm-up)", "prompts": a.prompts,
                      "group_size": a.group_size, "n_minibatches": 4, "max_new_tokens": a.max_new_tokens,
                      "max_running_requests": a.max_running,
                      "device": a.device,
                      "model": {"hidden": a.hidden, "layers": a.layers, "intermediate": a.intermediate}
                      if a.model == "own" else {"name": a.model, **hf_inputs.MODELS[a.model],
                                                "weights": "random (transformers init), bf16 checkpoint"},
                      "reward": hf_inputs.PARITY_REWARD,
                      "warm_start_iters": 0, "seed": a.seed, "smoke": a.smoke}}
    runs, res["core_speed"] = interleave(a.policies.split(","), a, out, pinned)
    for r in runs.values():
        ev = r["_events"]
        steady = [s["seconds"] - group_creation_s(ev, s["step"]) for s in r["steps"][1:]]
        r["steady_step_s"] = sum(steady) / max(1, len(steady))
        r["group_creation_s"] = sum(group_creation_s(ev, s["step"]) for s in r["steps"][1:])
        r["event_summary"] = event_summary(ev, len(r["steps"]))
    res["runs"] = {k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in runs.items()}
    for pol in ("static", "collocated", "rlinf", "tidal"):
        if pol in runs:
            res[f"{pol}_step_s"] = runs[pol]["step_s"]
    if "tidal" in runs and "static" in runs:
        res["speedup_vs_static"] = runs["static"]["step_s"] / runs["tidal"]["step_s"]
        res["steady_speedup_vs_static"] = runs["static"]["steady_step_s"] / runs["tidal"]["steady_step_s"]
    for label in runs:
        if "+" in label and "static" in runs:   # variants: the same figures as tidal's, under their label
            v = runs[label]
            res.setdefault("variants", {})[label] = {
                "step_s": v["step_s"], "speedup_vs_static": runs["static"]["step_s"] / v["step_s"],
                "paired_speedup_vs_static": paired(runs["static"]["steps"], v["steps"]),
                "paired_pump_speedup_vs_static": paired(runs["static"]["steps"], v["steps"], "pumps")}
    for base in ("rlinf", "collocated"):
        if "tidal" in runs and base in runs:
            res[f"speedup_vs_{base}"] = runs[base]["step_s"] / runs["tidal"]["step_s"]
            res[f"steady_speedup_vs_{base}"] = runs[base]["steady_step_s"] / runs["tidal"]["steady_step_s"]
    for base in ("static", "rlinf", "collocated"):
        if "tidal" in runs and base in runs:
            res[f"paired_speedup_vs_{base}"] = paired(runs[base]["steps"], runs["tidal"]["steps"])
            res[f"paired_pump_speedup_vs_{base}"] = paired(runs[base]["steps"], runs["tidal"]["steps"], "pumps")
    seq_tokens = 9 + (sum(s["response_len_mean"] for s in runs.get("static", {}).get("steps", [])[1:]) /
                      max(1, len(runs.get("static", {}).get("steps", [])[1:])) or a.max_new_tokens / 2)
    per_iter = a.prompts * a.group_size // 4
    res["cost_fit"], fitted = (fit(runs, per_iter * seq_tokens, -(-per_iter // MICRO_BATCH), a.prompts,
                                   a.group_size * seq_tokens) if "static" in runs else ({}, None))
    if fitted is not None:
        res["fitted_prediction"] = predicted(fitted, list(runs), a, out, {k: v["step_s"] for k, v in runs.items()})
    if not a.no_sim:
        short = a.quick or a.smoke
        res["simulator"] = sim_figures(4 if short else 10, 1 if short else 3,
                                       build("tidal", a, out) if a.model == "own" and a.device == "cpu" else None)
    res["machine"]["load_avg_end"] = os.getloadavg()
    res["wall_s"] = time.monotonic() - t0
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    table(res)
    print(json.dumps({k: v for k, v in res.items() if k.endswith("_s") or k.startswith(("speedup", "steady"))},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
