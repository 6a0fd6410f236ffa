"""A device lost mid-step: recovery in place against stop-and-resume from the last checkpoint, on the same run.

    python benchmarks/faults.py --json benchmarks/results/faults/<date>_<commit7>_<machine>.json
    python benchmarks/faults.py --quick --json /tmp/faults.json        # CPU virtual devices, a few minutes
    python benchmarks/faults.py --smoke --json /tmp/faults.json        # the test suite's smoke run (K = 4)

One run (actor on device 0, rollout instances 1-2, inference 3-4, `run.checkpoint_every` = 10), in four parts, all
real `TrainingRun`s (Ray workers, the native engine, the actor), in this process:

    clean       steps 0 .. K+1 without a fault: per-step seconds and tokens; checkpoints after step 10 (the run's)
                and after step K-1 (only to start the faulted parts there: the same run, resumed bit-exactly; step
                K-1 runs first, so the faulted step is not the first of its process)
    rollout     from step K-1: kill -9 of rollout instance 2's worker during step K's generation (as it is handed
                more groups, some groups back); the run recovers in place (`tidal.pipeline.faults`), a replacement
                worker rejoins (`cluster.replace_failed`), and step K+1 runs; then, outside the run's time, the
                benchmark waits for the replacement, to report when the device was back in the free pool
    inference   the same with inference device 4's worker, as it is handed its first groups to score in step K
    actor       with `actor.redundancy: host` (a copy of the run's state in host memory after every step): kill -9
                of the actor's worker (device 0) as step K's first iter is handed to it; the step cannot absorb
                that, so the run carries on in process with its surviving workers from the copy kept after step
                K-1 (`TrainingRun.recover`, as `run_training` does: the actor moves to a rollout device,
                tidal/pipeline/survivors.py) and redoes step K; a replacement for device 0 rejoins the free pool
    resume      stop-and-resume: a new run resumed from the checkpoint of step 10 (workers started, checkpoint
                loaded, held-out evaluation, as `tidal train --resume` does) redoes steps 10 .. K

K = 15 by default: a fault falls on average half a checkpoint interval after the last checkpoint. `--smoke` runs the
same parts at toy sizes (`checkpoint_every` 2, K = 4, 16 prompts; the rollout and actor cases, one of each kind of
recovery) from the random init with the parity reward instead of the warm start (`tests/parity_reward.py`: about half
of every group rewarded, so every step trains and equal final weights say something): it checks the code path, its
figures measure nothing.

Figures per case (`cases.rollout`, `cases.inference`), recovery beside stop-and-resume:

    kill_offset_s          when in step K the worker was killed (from the step's start)
    kill_to_step_end_s     kill -> step K's end (its update made: the next useful step), measured
    lost_s                 kill_to_step_end_s - what step K had left without the fault (that run's step K seconds
                           - kill_offset_s): the wall time the fault cost the run. Resume: the new process (its
                           imports, measured in a fresh interpreter), opening the run, steps 10 .. K-1 again and step
                           K's first kill_offset_s again; recovery: the faulted step's extra time
    tokens_redone          response tokens generated or scored again, once per operation (recovery: the
                           `device_recovered` event; actor: step K's groups generated before the kill offset in the
                           clean run; resume: steps 10 .. K-1 generated and scored, plus step K's groups generated
                           before the kill offset); the actor's iters redone are not counted
    lost_work_ratio        lost_s of stop-and-resume / lost_s of recovery (goal: >= 5)
    tokens_ratio           tokens_redone likewise
    recovery_within_steps  kill_to_step_end_s / the clean run's median step (goal: <= 2)

and `same_final_weights`: each faulted part ends with the clean run's weights, bit for bit. `redundancy`: the
cost of `actor.redundancy: host` in the actor case's run: `copy_s` (mean seconds of one copy, a step's overhead:
it runs between steps), `copy_bytes` (host memory it holds) and `copy_over_median_step`; the devices hold nothing
more.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tidal.core.config import build_config
from tidal.core.provenance import commit
from tidal.pipeline.cluster import CallKind
from tidal.pipeline.run import TrainingRun
from tidal.workers.errors import WorkerDied, WorkerTimeout

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/: the shared inputs
from hf_inputs import PARITY_REWARD, importable_from_root

CHECKPOINT_EVERY = 10
KILL_STEP = 15
QUICK = {
    "run": {"seed": 5, "checkpoint_every": CHECKPOINT_EVERY, "eval_every": 1000},
    "cluster": {"num_devices_per_node": 5, "component_placement": {"actor": "0", "rollout": "1-2",
                                                                    "inference": "3-4"},
                "replace_failed": True},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 8, "max_running_requests": 8},
    "algorithm": {"group_size": 4, "n_minibatches": 2},
    "data": {"rollout_batch_size": 32, "eval_size": 8},
    "warm_start": {"iters": 600, "num_examples": 500, "lr": 3e-3, "eval_every": 1000},
}
FULL = {**QUICK, "model": {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
                           "intermediate_size": 512, "max_seq_len": 64},
        "rollout": {"max_new_tokens": 24, "max_running_requests": 16},
        "data": {"rollout_batch_size": 32, "eval_size": 16}}
#: `--smoke`: the quick run's code path at toy sizes, killed in step SMOKE_KILL_STEP
SMOKE = {**QUICK, "run": {**QUICK["run"], "checkpoint_every": 2},
         "data": {"rollout_batch_size": 16, "eval_size": 4},
         "warm_start": {"iters": 0}, "reward": {"function": PARITY_REWARD}}
SMOKE_KILL_STEP = 4
#: the faulted parts; rollout and inference recover in place alike, actor restarts from the host copy
CASES = ("rollout", "inference", "actor")
SMOKE_CASES = ("rollout", "actor")


def machine() -> str:
    import torch
    info = f"{os.cpu_count()} {platform.machine()} CPU cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        info = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, " + info
    return info


def step_tokens(pipe) -> tuple[int, dict[int, float]]:
    """The step's response tokens (each generated once and scored once), and when each group was back generated
    (seconds from the step's start)."""
    st = pipe.step_state
    tokens = sum(len(r) for g in st.scored.values() for r in g.response_ids)
    return tokens, {gid: t - st.t_start for gid, t in st.gen_time.items()}


def group_tokens(pipe) -> dict[int, int]:
    return {gid: sum(len(r) for r in g.response_ids) for gid, g in pipe.step_state.scored.items()}


def run_steps(run: TrainingRun, until: int, checkpoints: dict[int, Path] | None = None) -> list[dict]:
    """Steps up to `until` (exclusive): per step its seconds, tokens and group times; checkpoints after the steps
    `checkpoints` names (the run's next step then). With `actor.redundancy: host`, as `run_training` does: a host
    copy after every step, and a lost device the step cannot absorb restarts the run from it (a restarted step is
    listed once, as it ran the second time)."""
    out = []
    host = run.cfg.actor.redundancy == "host"
    while run.next_step < until:
        t0 = time.monotonic()
        try:
            run.step()
        except (WorkerDied, WorkerTimeout) as failure:
            if not host:
                raise
            run.recover(failure)
            continue
        end = time.monotonic()
        pipe = run.pipe
        tokens, gen = step_tokens(pipe)
        out.append({"step": run.next_step - 1, "seconds": end - t0, "tokens": tokens, "gen_s": gen,
                    "group_tokens": group_tokens(pipe), "ended_at": end})
        if checkpoints and run.next_step in checkpoints:
            run.checkpoint(checkpoints[run.next_step])
        if host:
            t1 = time.monotonic()
            run.keep_host_copy()
            out[-1]["copy_s"] = time.monotonic() - t1
    return out


def import_seconds() -> float:
    """A fresh interpreter importing what `tidal train` imports before it starts a run."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import ray, torch, tidal.pipeline.run, tidal.cli.train"], check=True)
    return time.monotonic() - t0


def faulted(cfg, out: Path, start: Path, kill_step: int, which: str) -> dict:
    """From the checkpoint after step `kill_step` - 1: that step, step `kill_step` with a worker killed in it, then
    one more step."""
    run = TrainingRun(cfg, out / f"faulted-{which}")
    killed: list[tuple[float, float]] = []   # (monotonic, the pipeline's clock) at the kill
    try:
        run.open(resume_from=start)
        pipe = run.pipe
        assert pipe is not None

        def kill(device: int) -> None:
            killed.append((time.monotonic(), pipe.clock(), pipe.clock() - pipe.step_state.t_start))
            os.kill(pipe.group.pid(device), signal.SIGKILL)

        def kill_on_submit(call: CallKind, victim: int) -> None:
            """Kill `victim` as step `kill_step` hands it its first call of kind `call`."""
            track = pipe.cluster.track

            def spy_submit(kind, handle, payload=None):
                f = track(kind, handle, payload)
                device = handle.device_id
                if kind is call and device == victim and pipe.step_state.step == kill_step and not killed:
                    kill(victim)
                return f
            pipe.cluster.track = spy_submit

        if which == "actor":   # the first iter of step K: the step cannot absorb it, the run restarts
            kill_on_submit(CallKind.ACTOR, 0)
            run.keep_host_copy()   # as run_training does before its first step
        elif which == "rollout":
            submit_slice = pipe.cluster.submit_slice

            def spy_slice(device, groups, budget_s):
                f = submit_slice(device, groups, budget_s)
                st = pipe.step_state
                if device == 2 and st.step == kill_step and groups and st.generated and not killed:
                    kill(2)
                return f
            pipe.cluster.submit_slice = spy_slice
        else:
            kill_on_submit(CallKind.INFERENCE, 4)
        steps = run_steps(run, kill_step + 2)
        if which == "actor":
            assert run.host_copy is not None
            copy_bytes = sum(f.stat().st_size for f in run.host_copy.rglob("*") if f.is_file())
        pipe = run.pipe   # the same pipeline unless every worker was replaced
        pipe.rejoin.wait(kill_step + 1, timeout_s=180)   # only to report when it came back: the run never waits
        summary = run.finish()
        events = [e for e in pipe.cluster.events if e["kind"].startswith("device_")]
        t_close = time.monotonic()
    finally:
        run.close()
        run.drop_host_copy()
    close_s = time.monotonic() - t_close
    step = steps[1]
    assert killed and step["step"] == kill_step, f"no {which} worker was killed in step {kill_step}"
    if which == "actor":   # carried on in process from the host copy kept after step K-1
        (restart,) = run.restarts
        copies = [s["copy_s"] for s in steps if "copy_s" in s]
        rejoined = next((e for e in events if e["kind"] == "device_rejoined"), None)
        return {"kill_offset_s": killed[0][2], "kill_to_step_end_s": step["ended_at"] - killed[0][0],
                "step_s": step["seconds"], "next_step_s": steps[2]["seconds"], "recovery_s": restart["seconds"],
                "workers": restart["workers"], "layout": [restart.get("layout_from"), restart.get("layout_to")],
                "abandon_s": restart.get("abandon_s"), "load_s": restart.get("load_s"),
                "restarted_from": restart["source"], "steps_redone": restart["steps_redone"], "close_s": close_s,
                "detect_s": restart["time"] - killed[0][1], "copy_s": statistics.mean(copies), "copy_bytes": copy_bytes,
                "rejoin_s": rejoined["seconds"] if rejoined else None,
                "final_weights_sha": summary.final_weights_sha}
    started = step["ended_at"] - step["seconds"]
    ev = {e["kind"]: e for e in events}
    failed, recovered = ev["device_failed"], ev["device_recovered"]
    rejoined = ev.get("device_rejoined")
    return {"kill_offset_s": killed[0][0] - started, "kill_to_step_end_s": step["ended_at"] - killed[0][0],
            "step_s": step["seconds"], "next_step_s": steps[2]["seconds"], "detect_s": failed["time"] - killed[0][1],
            "handover_s": failed["seconds"], "handover_bytes": failed["bytes"], "groups_redone": failed["groups"],
            "recovery_s": recovered["seconds"], "tokens_redone": recovered["tokens"],
            "rejoin_s": rejoined["seconds"] if rejoined else None,
            "rejoin_start_s": rejoined["start_s"] if rejoined else None,
            "rejoined_in_step": rejoined["step"] if rejoined else None, "close_s": close_s,
            "final_weights_sha": summary.final_weights_sha, "events": events}


def resumed(cfg, out: Path, ckpt: Path, kill_step: int) -> dict:
    """Stop-and-resume: a new run from the checkpoint `ckpt` (of step 10 at the default sizes), through step
    `kill_step`."""
    run = TrainingRun(cfg, out / "resumed")
    try:
        t0 = time.monotonic()
        run.open(resume_from=ckpt)
        open_s = time.monotonic() - t0
        first = run.next_step
        steps = run_steps(run, kill_step + 1)
    finally:
        run.close()
    return {"from_step": first, "open_s": open_s, "steps": steps, "t_open": t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--quick", action="store_true", help="tiny model, CPU virtual devices (a few minutes)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"a smoke run of --quick's code path, its figures meaningless: checkpoint_every 2, "
                         f"--kill-step {SMOKE_KILL_STEP}, 16 prompts, --cases {','.join(SMOKE_CASES)}, the random "
                         f"init and the parity reward")
    ap.add_argument("--cases", default=None,
                    help=f"comma-separated, of {', '.join(CASES)} (default: all; --smoke: {','.join(SMOKE_CASES)})")
    ap.add_argument("--kill-step", type=int, default=None,
                    help=f"the step a worker is killed in (> checkpoint_every + 1; default {KILL_STEP}, --smoke "
                         f"{SMOKE_KILL_STEP})")
    ap.add_argument("--work", default="runs/faults", help="run folders, checkpoints, the warm start's cache")
    a = ap.parse_args(argv)
    picked = a.cases.split(",") if a.cases else list(SMOKE_CASES if a.smoke else CASES)
    if not picked or any(c not in CASES for c in picked):
        raise SystemExit(f"--cases {a.cases!r}: give a comma-separated list of {', '.join(CASES)}")
    base = SMOKE if a.smoke else QUICK if a.quick else FULL
    every = base["run"]["checkpoint_every"]
    a.kill_step = a.kill_step or (SMOKE_KILL_STEP if a.smoke else KILL_STEP)
    if a.kill_step <= every + 1:
        raise SystemExit(f"--kill-step {a.kill_step}: give a step after {every + 1} (the checkpoint of step "
                         f"{every} and one step after it)")
    work = Path(a.work) / datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    K = a.kill_step
    overrides = [f"run.output_dir={Path(a.work).resolve()}", f"run.num_steps={K + 2}"]
    if a.quick or a.smoke:
        overrides.append("cluster.device=cpu")
    if a.smoke:
        importable_from_root()   # the parity reward's module, on the workers' path too
    cfg = build_config(base, overrides)
    res: dict = {"name": "faults", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "commit": commit(), "machine": machine(), "command": " ".join(sys.argv),
                 "config": {"placement": "actor 0, rollout 1-2, inference 3-4", "checkpoint_every": every,
                            "kill_step": K, "cases": picked, "smoke": a.smoke, "model": cfg.model.model_dump(),
                            "prompts": cfg.data.rollout_batch_size, "group_size": cfg.algorithm.group_size,
                            "max_new_tokens": cfg.rollout.max_new_tokens}}

    def save() -> None:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))

    ck_every, ckk = work / f"checkpoints-{every}", work / f"checkpoints-{K - 1}"
    run = TrainingRun(cfg, work / "clean")
    try:
        run.open()
        clean = run_steps(run, K + 2, {every: ck_every, K - 1: ckk})
        clean_sha = run.finish().final_weights_sha
    finally:
        run.close()
    by_step = {s["step"]: s for s in clean}
    median_step = statistics.median(s["seconds"] for s in clean[1:])
    res["clean"] = {"median_step_s": median_step, "final_weights_sha": clean_sha,
                    "steps": [{k: s[k] for k in ("step", "seconds", "tokens")} for s in clean]}
    save()
    imports = import_seconds()
    back = resumed(cfg, work, ck_every, K)
    res["resume"] = {"import_s": imports, "open_s": back["open_s"],
                     "steps": [{k: s[k] for k in ("step", "seconds", "tokens")} for s in back["steps"]]}
    save()
    cases = {}
    redundant = build_config(base, [*overrides, "actor.redundancy=host"])
    for which in picked:
        rec = faulted(redundant if which == "actor" else cfg, work, ckk, K, which)
        off = rec["kill_offset_s"]
        rec_lost = rec["kill_to_step_end_s"] - (by_step[K]["seconds"] - off)
        if which == "actor":   # step K redone from its start: what it had generated before the kill, again
            rec["tokens_redone"] = sum(n for gid, n in by_step[K]["group_tokens"].items()
                                       if by_step[K]["gen_s"].get(gid, 1e9) < off)
            res["redundancy"] = {"copy_s": rec["copy_s"], "copy_bytes": rec["copy_bytes"],
                                 "copy_over_median_step": rec["copy_s"] / median_step}
        # stop-and-resume of the same kill: a new process and run, steps 10 .. K-1 again, step K's first `off` again
        redo, last = back["steps"][:-1], back["steps"][-1]
        stop_s = rec["detect_s"] + rec["close_s"]   # the fault seen, the old run's workers shut down
        to_end = stop_s + imports + back["open_s"] + sum(s["seconds"] for s in redo) + last["seconds"]
        res_lost = to_end - (last["seconds"] - off)
        before_kill = sum(n for gid, n in by_step[K]["group_tokens"].items() if last["gen_s"].get(gid, 1e9) < off)
        res_tokens = sum(2 * s["tokens"] for s in redo) + before_kill   # generated and scored again
        cases[which] = {
            "recovery": {**{k: v for k, v in rec.items() if k != "final_weights_sha"}, "lost_s": rec_lost},
            "stop_and_resume": {"kill_to_step_end_s": to_end, "lost_s": res_lost, "stop_s": stop_s,
                                "restart_s": imports + back["open_s"], "steps_redone": len(redo),
                                "tokens_redone": res_tokens},
            "lost_work_ratio": res_lost / rec_lost if rec_lost > 0 else None,
            "tokens_ratio": res_tokens / rec["tokens_redone"] if rec["tokens_redone"] else None,
            "recovery_within_steps": rec["kill_to_step_end_s"] / median_step,
            "same_final_weights": rec["final_weights_sha"] == clean_sha}
        res["cases"] = cases
        save()
    print(f"{'case':<10} {'kill->end s':>11} {'lost s':>7} {'tokens':>7} | {'resume kill->end s':>18} "
          f"{'lost s':>7} {'tokens':>7} | {'lost ratio':>10} {'steps':>6} same")
    for which, c in cases.items():
        r, s = c["recovery"], c["stop_and_resume"]
        ratio = "-" if c["lost_work_ratio"] is None else f"{c['lost_work_ratio']:.1f}"
        print(f"{which:<10} {r['kill_to_step_end_s']:11.2f} {r['lost_s']:7.2f} {r['tokens_redone']:7d} | "
              f"{s['kill_to_step_end_s']:18.2f} {s['lost_s']:7.2f} {s['tokens_redone']:7d} | {ratio:>10} "
              f"{c['recovery_within_steps']:6.2f} {c['same_final_weights']}")
    return 0 if all(c["same_final_weights"] for c in cases.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
