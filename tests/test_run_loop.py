"""The run loop, written once (`tidal.pipeline.run_loop`): each step's phases as pure decisions, table-driven; the
loop's recovery and closing; and `tidal train`'s driver (`DirectRun`) and the `rl-training` flow's (`FlowRun`, its
tasks and `rl-step` subflows on a temporary local Prefect server) making the same calls, in the same order, on a
recording run for the same config (steps, evaluations, checkpoints, host copies, a recovery, a resume, a failure
past `run.max_restarts`). The sweep loop (`tidal.sweep.sweep_loop`) likewise: `tidal sweep` and the
`policy-sweep` flow make the same calls, and on the simulator find the same trials."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tidal.core.errors import ConfigError
from tidal.pipeline.run import DirectRun
from tidal.pipeline.run_loop import (
    RECOVERABLE,
    LoopSettings,
    Phase,
    StepPlan,
    plan_step,
    run_loop,
)
from tidal.sweep import SweepReport, TrialResult, TrialSpec, sweep_loop
from tidal.workers.errors import WorkerCallError, WorkerDied, WorkerTimeout

R, S, E, C, H = Phase.RUN_STEP, Phase.SYNC_WEIGHTS, Phase.EVALUATE, Phase.CHECKPOINT, Phase.HOST_COPY
W = Phase.RECORD


def _loop(num_steps: int = 3, eval_every: int = 1, checkpoint_every: int = 0, host_copy: bool = False,
          max_restarts: int = 2) -> LoopSettings:
    return LoopSettings(num_steps, eval_every, checkpoint_every, host_copy, max_restarts)


# ---- the decisions --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loop, phases", [
    # the module doc's worked example: evaluation every 2 steps and after the last, a checkpoint after the last
    (_loop(3, eval_every=2), [(R, S, W), (R, S, E, W), (R, S, E, W, C)]),
    # a checkpoint every 2 steps; the host copy after each step that takes none (a checkpoint is the newer state)
    (_loop(5, eval_every=5, checkpoint_every=2, host_copy=True),
     [(R, S, W, H), (R, S, W, C), (R, S, W, H), (R, S, W, C), (R, S, E, W, C)]),
    # one step: evaluated and checkpointed, as the last
    (_loop(1, eval_every=7, checkpoint_every=3, host_copy=True), [(R, S, E, W, C)]),
])
def test_each_steps_phases_follow_the_config(loop, phases):
    assert [plan_step(loop, s).phases for s in range(loop.num_steps)] == phases


def test_a_plan_names_its_step_and_what_it_does_after_the_record():
    plan = plan_step(_loop(4, eval_every=2, checkpoint_every=2), 1)
    assert plan == StepPlan(1, (R, S, E, W, C)) and plan.evaluates and plan.checkpoints
    assert not plan_step(_loop(4, eval_every=2, checkpoint_every=2), 0).evaluates
    with pytest.raises(AssertionError):
        plan_step(_loop(4), 4)   # past the run's last step: no plan


def test_settings_are_read_from_the_config_once():
    from tidal.core.config import build_config
    cfg = build_config({"run": {"num_steps": 7, "eval_every": 3, "checkpoint_every": 2, "max_restarts": 4},
                        "actor": {"redundancy": "host"}})
    assert LoopSettings.from_config(cfg) == LoopSettings(7, 3, 2, True, 4)


# ---- a run that records what it is asked ----------------------------------------------------------------------

@dataclass
class RecordingRun:
    """A `TrainingRun`'s verbs over no workers, each call recorded as (verb, the step under way). `fail` raises each
    (verb, step) listed once; `recover` goes back to the newest state kept (a checkpoint or the host copy)."""

    next_step: int = 0
    fail: list[tuple[str, int]] = field(default_factory=list)
    out_dir: Path = Path("recorded")
    calls: list[tuple[str, int]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    kept: int = 0

    def __post_init__(self) -> None:
        self.kept = self.next_step

    def _do(self, verb: str) -> None:
        self.calls.append((verb, self.next_step))
        if (verb, self.next_step) in self.fail:
            self.fail.remove((verb, self.next_step))
            raise WorkerDied(0, f"killed in {verb}")

    def run_step(self, sync: bool = True) -> dict[str, float]:
        assert not sync   # the loop syncs as a phase of its own
        self._do("run_step")
        return {"step/time_s": 0.1}

    def sync_weights(self) -> dict[str, float]:
        self._do("sync_weights")
        return {"sync/time_s": 0.0}

    def evaluate(self) -> float:
        self._do("evaluate")
        return 0.5

    def record(self) -> dict[str, float]:
        self._do("record")
        self.next_step += 1
        return {"step/time_s": 0.1, "grpo/reward_mean": 0.25}

    def checkpoint(self) -> Path:
        self._do("checkpoint")
        self.kept = self.next_step
        return Path("gen")

    def keep_host_copy(self) -> Path:
        self._do("keep_host_copy")
        self.kept = self.next_step
        return Path("copy")

    def recover(self, failure: Exception) -> dict[str, Any]:
        self.calls.append(("recover", self.next_step))
        self.next_step = self.kept
        rec = {"device": 0, "role": "actor", "resumed_step": self.kept, "source": "checkpoint",
               "resumed_from": "/kept/gen-1", "workers": "kept"}
        self.restarts.append(rec)
        return rec

    def drain_warnings(self) -> list[Any]:
        return []

    def finish(self) -> SimpleNamespace:
        self.calls.append(("finish", self.next_step))
        return SimpleNamespace(to_json=lambda: {"name": "recorded", "steps": self.next_step})

    def close(self) -> None:
        self.calls.append(("close", self.next_step))

    def drop_host_copy(self) -> None:
        self.calls.append(("drop_host_copy", self.next_step))


def _direct(loop: LoopSettings, first_step: int, fail: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], str]:
    """What `run_training` asks of the run (`DirectRun`), and how the loop ended."""
    run = RecordingRun(first_step, list(fail))
    try:
        run_loop(DirectRun(run), loop, first_step)   # type: ignore[arg-type]   # a recording stand-in
        ended = "FINISHED"
    except WorkerDied:
        ended = "FAILED"
    return run.calls, ended


CASES = {
    "evaluate every 2": (_loop(3, eval_every=2), 0, []),
    "host copy, checkpoint every 2, a device lost in step 2's sync": (
        _loop(4, eval_every=4, checkpoint_every=2, host_copy=True), 0, [("sync_weights", 2)]),
    "lost in the record after a host copy: the step again": (
        _loop(3, host_copy=True), 0, [("record", 1)]),
    "resumed at step 2": (_loop(4, checkpoint_every=3), 2, []),
    "restarts spent": (_loop(3, max_restarts=1), 0, [("run_step", 1), ("evaluate", 1)]),
}


def test_the_direct_loop_makes_exactly_these_calls():
    step = ("run_step", "sync_weights", "record")
    calls, ended = _direct(*CASES["host copy, checkpoint every 2, a device lost in step 2's sync"])
    assert ended == "FINISHED" and calls == [
        ("keep_host_copy", 0),                                            # the state before the first step
        *[(v, 0) for v in step], ("keep_host_copy", 1),
        *[(v, 1) for v in step], ("checkpoint", 2),
        ("run_step", 2), ("sync_weights", 2), ("recover", 2),            # back to the checkpoint after step 1
        *[(v, 2) for v in step], ("keep_host_copy", 3),
        ("run_step", 3), ("sync_weights", 3), ("evaluate", 3), ("record", 3), ("checkpoint", 4),
        ("finish", 4), ("close", 4), ("drop_host_copy", 4)]

    step = ("run_step", "sync_weights", "evaluate", "record")
    calls, ended = _direct(*CASES["restarts spent"])   # max_restarts=1: the second loss ends the run
    assert ended == "FAILED" and calls == [
        *[(v, 0) for v in step], ("run_step", 1), ("recover", 1),
        *[(v, 0) for v in step], ("run_step", 1), ("sync_weights", 1), ("evaluate", 1),
        ("close", 1), ("drop_host_copy", 1)]

    calls, ended = _direct(*CASES["resumed at step 2"])
    assert ended == "FINISHED" and calls == [
        *[(v, 2) for v in step], ("checkpoint", 3), *[(v, 3) for v in step], ("checkpoint", 4),
        ("finish", 4), ("close", 4), ("drop_host_copy", 4)]


class StopsAtStep1:
    """Loop verbs whose step 1 raises `stop`; `closed` holds the status the loop closed with."""

    def __init__(self, stop: BaseException):
        self.stop, self.closed = stop, []

    def keep_host_copy(self) -> None: ...

    def step(self, plan: StepPlan) -> dict[str, float]:
        if plan.step == 1:
            raise self.stop
        return {}

    def recover(self, failure: Exception) -> int:
        raise AssertionError("not a recoverable failure")

    def report(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self) -> str:
        return "summary"

    def close(self, status: str) -> None:
        self.closed.append(status)


@pytest.mark.parametrize("stop, status", [
    (KeyboardInterrupt(), "KILLED"),                       # Ctrl-C, SIGTERM to `tidal train`
    (ConfigError("x", 1, "bad", "fix"), "FAILED"),
    (WorkerCallError(0, "fn", "Traceback ..."), "FAILED"),   # the worker's own code: it would only repeat
])
def test_the_loop_closes_the_run_with_the_status_of_what_ended_it(stop, status):
    verbs = StopsAtStep1(stop)
    with pytest.raises(type(stop)):
        run_loop(verbs, _loop(3), 0)
    assert verbs.closed == [status]
    done = StopsAtStep1(stop)
    assert run_loop(done, _loop(1), 0) == "summary" and done.closed == ["FINISHED"]


def test_a_hung_call_and_a_lost_device_are_recoverable_a_workers_own_error_is_not():
    assert set(RECOVERABLE) == {WorkerDied, WorkerTimeout}


# ---- the flow makes the same calls ----------------------------------------------------------------------------

def _flow(loop: LoopSettings, first_step: int, fail: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], str]:
    """What the `rl-training` flow's loop (`FlowRun`: its tasks, an `rl-step` subflow per step) asks of the run,
    and the status `close-run` ended its tracking with."""
    from prefect import flow

    from flows.rl_training import FlowRun
    from tasks import registry
    from tasks.training import OpenedRun, _Live
    run = RecordingRun(first_step, list(fail))
    closed: list[str] = []
    tracking = SimpleNamespace(sink=None, close=lambda status, artifacts=(): closed.append(status))
    key = registry.put("run", _Live(run, tracking))  # type: ignore[arg-type]   # a recording stand-in
    opened = OpenedRun(key, "recorded", "static", "", None, None, loop, first_step)

    @flow(name="loop-under-test")
    def drive() -> dict[str, Any]:
        return run_loop(FlowRun(opened), opened.loop, opened.first_step)

    state = drive(return_state=True)
    registry.pop(key)
    assert closed == ["FINISHED" if state.is_completed() else "FAILED"], (closed, state)
    return run.calls, closed[0]


def test_the_flow_and_the_cli_make_the_same_calls_for_the_same_config(local_prefect):
    for name, (loop, first_step, fail) in CASES.items():
        assert _flow(loop, first_step, fail) == _direct(loop, first_step, fail), name


# ---- the sweep loop: `tidal sweep` and the policy-sweep flow ------------------------------------------------------

@dataclass
class RecordingSweep:
    """A `Sweep`'s verbs over no study: each call recorded; trial `fail_at` raises in `evaluate`."""

    fail_at: int | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    asked: int = 0

    def ask(self) -> TrialSpec:
        self.calls.append(("ask", self.asked))
        self.asked += 1
        return TrialSpec(self.asked - 1, {"scheduler.policy": "rlinf"})

    def evaluate(self, spec: TrialSpec) -> TrialResult:
        self.calls.append(("evaluate", spec.number))
        if spec.number == self.fail_at:
            raise RuntimeError("the simulator broke")
        return TrialResult(spec.number, spec.params, "COMPLETE", {"step_time": 1.0 + spec.number})

    def report(self) -> SweepReport:
        self.calls.append(("report", self.asked))
        best = {"number": 0, "params": {"scheduler.policy": "rlinf"}, "values": {"step_time": 1.0},
                "mlflow_run_id": None}
        return SweepReport("recorded", "sqlite://", ["step_time"], ["minimize"], self.asked, 0, 0, best["params"],
                           best["values"], None, [best], None, trials=[{**best, "state": "COMPLETE", "metrics":
                                                                        best["values"], "error": None}])

    def close(self, status: str = "FINISHED") -> None:
        self.calls.append(("close", status))


def _sweep_direct(trials: int, fail_at: int | None) -> list[tuple[str, Any]]:
    sweep = RecordingSweep(fail_at)
    with contextlib.suppress(RuntimeError):
        sweep_loop(sweep, trials)
    return sweep.calls


def _sweep_flow(trials: int, fail_at: int | None) -> list[tuple[str, Any]]:
    from prefect import flow

    from tasks import registry
    from tasks.sweep import SweepTasks
    sweep = RecordingSweep(fail_at)
    key = registry.put("sweep", sweep)

    @flow(name="sweep-loop-under-test")
    def drive() -> dict[str, Any]:
        return sweep_loop(SweepTasks(key), trials)

    drive(return_state=True)
    assert registry.pop(key) is None   # close-sweep took it out
    return sweep.calls


def test_the_sweep_flow_and_tidal_sweep_make_the_same_calls(local_prefect):
    assert _sweep_direct(3, None) == [("ask", 0), ("evaluate", 0), ("ask", 1), ("evaluate", 1), ("ask", 2),
                                      ("evaluate", 2), ("report", 3), ("close", "FINISHED")]
    for trials, fail_at in ((3, None), (3, 1), (1, None)):
        assert _sweep_flow(trials, fail_at) == _sweep_direct(trials, fail_at), (trials, fail_at)
    assert _sweep_direct(3, 1)[-1] == ("close", "FAILED")


def test_the_policy_sweep_flow_finds_what_tidal_sweep_finds(local_prefect, tmp_path, monkeypatch):
    """The same space, seed and trials in two fresh studies: the flow's report and `run_sweep`'s hold the same
    trials, settings and values."""
    from flows.policy_sweep import policy_sweep
    from tasks.requests import SweepRequest
    from tidal.sweep import load_space, run_sweep
    monkeypatch.delenv("TIDAL_OPTUNA_STORAGE", raising=False)
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({
        "study": "same", "objectives": ["step_time", "reshards"],
        "simulator": {"workload": "rlinf-example", "devices": 8, "steps": 2, "seed": 3},
        "space": {"scheduler.policy": {"choices": ["static", "rlinf", "tidal"]},
                  "cluster.use_pre_process_policy": {"type": "bool"}}}))
    tracking = [f"tracking.db_url=sqlite:///{tmp_path}/tidal.db", f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db",
                f"tracking.mlflow_artifacts={tmp_path}/mlartifacts"]
    by_flow = policy_sweep(SweepRequest(space=str(space), trials=4, overrides=tracking,
                                        storage=f"sqlite:///{tmp_path}/flow-study.db"))
    by_cli = run_sweep(load_space(space), 4, overrides=tracking, storage=f"sqlite:///{tmp_path}/cli-study.db")

    def trials(report: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(t["number"], t["state"], t["params"], t["metrics"]) for t in report["trials"]]
    assert by_flow["n_trials"] == 4 and trials(by_flow) == trials(by_cli.to_json())
    assert (by_flow["best_params"], by_flow["best_values"]) == (by_cli.best_params, by_cli.best_values)
