"""A rollout or inference device lost mid-step costs its work, not the run (tidal/pipeline/faults.py).

The ledger's FAILED state and the recovery's pure parts are checked without a cluster; then worker processes are
killed with SIGKILL inside real runs (CPU virtual devices): one rollout instance while it generates, one
inference device while it scores. Each run completes on the survivors, records the failure, and ends with the
parameters of the run without a fault, bit for bit."""

import os
import signal
import time
from types import SimpleNamespace

import pytest
from training_equality import PARITY_REWARD, Trained, assert_same_training, start_weights, trained

from db import add_run, list_faults, list_transitions, open_database, session_scope
from tidal.core.config import build_config
from tidal.core.devices import DeviceLedger, IllegalTransition, Owner
from tidal.engine.checkpoint import latest, verify
from tidal.pipeline.cluster import CallKind, Flight
from tidal.pipeline.faults import lost_groups, overdue
from tidal.pipeline.recording import DbRecorder
from tidal.pipeline.run import TrainingRun
from tidal.pipeline.run_metrics import step_event_metrics, table_fields
from tidal.pipeline.timeline import Timeline
from tidal.workers import roles_ckpt
from tidal.workers.compute_share import process_alive
from tidal.workers.errors import WorkerDied

pytestmark = pytest.mark.usefixtures("shared_ray")


def test_a_failed_device_is_in_no_role_until_it_rejoins_the_free_pool():
    ledger = DeviceLedger(range(3), clock=lambda: 7.0)
    ledger.assign([0], Owner.ACTOR, "placement")
    ledger.assign([1, 2], Owner.ROLLOUT, "placement")
    failure = ledger.fail(2, "worker process 123 exited")
    assert (failure.device, failure.role, failure.reason, failure.time) == (2, Owner.ROLLOUT,
                                                                            "worker process 123 exited", 7.0)
    assert ledger.owned(Owner.FAILED) == (2,) and ledger.owned(Owner.ROLLOUT) == (1,)
    assert ledger.history[-1].reason == "worker process 123 exited"
    for move in (lambda: ledger.assign([2], Owner.ROLLOUT, "x"), lambda: ledger.release([2], "x"),
                 lambda: ledger.land([2], Owner.ACTOR, "x"), lambda: ledger.fail(2, "again")):
        with pytest.raises(IllegalTransition, match="device 2: failed -> "):
            move()
    ledger.rejoin(2, "answers again")
    assert ledger.owner(2) is Owner.FREE
    with pytest.raises(IllegalTransition, match="device 1: rollout -> free"):
        ledger.rejoin(1, "not failed")


def test_lost_groups_are_what_nothing_holds():
    assert lost_groups(6, generated=[0, 1], queued=[5], held=[2, 4]) == [3]
    assert lost_groups(4, generated=[], queued=[], held=[]) == [0, 1, 2, 3]
    assert lost_groups(3, generated=[0, 1, 2], queued=[], held=[]) == []


def test_overdue_names_the_oldest_late_generation_or_scoring_call():
    def fl(kind, device, t0):
        return Flight(kind, device, None, t0)   # type: ignore[arg-type]
    c = SimpleNamespace(inflight={1: fl(CallKind.ROLLOUT, 2, 5.0), 2: fl(CallKind.INFERENCE, 4, 1.0),
                                  3: fl(CallKind.ACTOR, 0, 0.0)})
    assert overdue(c, now=10.0, timeout_s=20.0) is None
    assert overdue(c, now=10.0, timeout_s=4.0) == (4, 9.0)   # the actor's iter is never "overdue" here
    assert overdue(c, now=10.0, timeout_s=8.5) == (4, 9.0)


def test_a_failure_is_a_row_of_the_events_table_and_counted_per_step():
    ev = {"kind": "device_failed", "time": 3.0, "step": 1, "device": 2, "role": "rollout", "reason": "exited",
          "calls_lost": 2, "overdue_s": None, "seconds": 0.03, "groups": 2, "groups_regenerated": [3, 4]}
    row = table_fields(ev)
    assert (row["component"], row["from"], row["to"], row["devices"], row["reason"]) == \
        ("rollout", "rollout", "failed", "2", "exited")
    m = step_event_metrics([ev])
    assert (m["device_failed/count"], m["device_failed/total_s"], m["device_failed/total_groups"]) == (1, 0.03, 2)


def test_a_recovery_and_a_rejoin_are_rows_of_the_events_table_and_marks_on_the_timeline(tmp_path):
    recovered = {"kind": "device_recovered", "time": 6.0, "step": 1, "device": 2, "role": "rollout", "seconds": 3.1,
                 "groups": 2, "tokens": 40, "failed_step": 1, "reason": "its 2 groups done again on the survivors"}
    rejoined = {"kind": "device_rejoined", "time": 9.0, "step": 1, "device": 2, "role": "rollout", "pid": 7,
                "seconds": 6.1, "start_s": 5.0, "setup_s": 1.1, "bytes": 5000, "reason": "replacement answers"}
    assert {k: table_fields(recovered)[k] for k in ("component", "what", "devices", "tokens")} == \
        {"component": "rollout", "what": "work redone", "devices": "2", "tokens": 40}
    assert {k: table_fields(rejoined)[k] for k in ("component", "from", "to", "devices", "bytes")} == \
        {"component": "rollout", "from": "failed", "to": "free", "devices": "2", "bytes": 5000}
    m = step_event_metrics([recovered, rejoined])
    assert (m["device_recovered/total_tokens"], m["device_rejoined/total_bytes"]) == (40, 5000)
    tl = Timeline()
    tl.add_owned([1, 2], "rollout", 0.0, 2.9)
    tl.add_down(2, "worker process 5 exited", 2.9, 9.0, rejoined=True)
    tl.add_recovery(2, "recovery 3.10s", 2.9, 6.0)
    tl.draw(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert tl.to_json()["down"] == [{"device": 2, "role": "rejoined", "what": "worker process 5 exited", "t0": 2.9,
                                     "t1": 9.0}]
    assert tl.idle_fraction(0.0, 9.0) == 1.0   # a failed device's spans are neither work nor idle time


# ---- real processes ---------------------------------------------------------------------------------------------
#: two rollout instances, two inference devices, the actor on one device; 4 slots per instance (its groups run in
#: waves, so a kill finds groups in flight)
SMALL = {
    "run": {"num_steps": 2, "seed": 5},
    "cluster": {"num_devices_per_node": 5, "component_placement": {"actor": "0", "rollout": "1-2",
                                                                    "inference": "3-4"}},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 8, "max_running_requests": 4},
    "algorithm": {"group_size": 4, "n_minibatches": 2},
    "data": {"rollout_batch_size": 8, "eval_size": 8},
    "warm_start": {"iters": 0},
    "reward": {"function": PARITY_REWARD},   # the random model's groups are half rewarded: every iter trains
}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One output folder for the module's runs."""
    return tmp_path_factory.mktemp("faults")


def _run(out, name, arm=None, overrides=(), recorder=None):
    """What the run trained (`Trained`), groups scored per step, the driver; `arm(pipe)` may set a fault up."""
    cfg = build_config(SMALL, [f"run.output_dir={out}", f"run.name={name}", *overrides])
    run = TrainingRun(cfg, out / name, recorder=recorder)
    try:
        run.open()
        start = start_weights(run)
        if arm is not None:
            arm(run.pipe)
        scored = []
        for _ in range(cfg.run.num_steps):
            run.step()
            scored.append(sorted(run.pipe.step_state.scored))
        run.finish()
        return trained(run, start), scored, run.pipe
    finally:
        run.close()


@pytest.fixture(scope="module")
def clean(out):
    """The run without a fault: (`Trained`, groups scored per step)."""
    ref, scored, _ = _run(out, "clean")
    return ref, scored


def _kill(pipe, device: int) -> None:
    os.kill(pipe.group.pid(device), signal.SIGKILL)


@pytest.mark.slow
def test_a_rollout_worker_killed_while_generating_costs_its_work_not_the_run(out, clean):
    """Step 1, generation under way (a group is back): as instance 2 is handed more groups, its worker is killed.
    What it held is regenerated on instance 1, and the run ends like the run without the fault."""
    killed: list[float] = []

    def arm(pipe):
        submit_slice = pipe.cluster.submit_slice

        def spy(device, groups, budget_s):
            f = submit_slice(device, groups, budget_s)
            st = pipe.step_state
            if device == 2 and st.step == 1 and groups and st.generated and not killed:
                killed.append(pipe.clock())
                _kill(pipe, 2)
            return f
        pipe.cluster.submit_slice = spy

    faulted, scored, pipe = _run(out, "rollout-killed", arm)
    assert killed
    (ev,) = [e for e in pipe.cluster.events if e["kind"] == "device_failed"]
    assert (ev["device"], ev["role"], ev["step"]) == (2, "rollout", 1) and ev["reason"], ev
    assert ev["groups_regenerated"] and ev["time"] - killed[0] < 20.0, (ev, killed)
    assert pipe.ledger.owner(2) is Owner.FAILED and pipe.placement.rollout == (1,)
    assert scored == clean[1] == [list(range(8))] * 2   # every group once
    assert_same_training(clean[0], faulted)


@pytest.mark.slow
def test_an_inference_worker_killed_while_scoring_costs_its_work_not_the_run(out, clean):
    """The worker of inference device 4 is killed as it is handed its first groups to score (in the first step
    that gives it any: device 3 may score a step's every group as they arrive); they are scored again on device 3
    within that step and the run ends like the run without the fault."""
    killed: list[tuple[int, list[int]]] = []

    def arm(pipe):
        track = pipe.cluster.track

        def spy(kind, handle, payload=None):
            f = track(kind, handle, payload)
            device = handle.device_id
            if kind is CallKind.INFERENCE and device == 4 and not killed:
                killed.append((pipe.step_state.step, [g.group_id for g in payload]))
                _kill(pipe, 4)
            return f
        pipe.cluster.track = spy

    faulted, scored, pipe = _run(out, "inference-killed", arm)
    assert killed
    (ev,) = [e for e in pipe.cluster.events if e["kind"] == "device_failed"]
    step, groups = killed[0]
    assert (ev["device"], ev["role"], ev["step"]) == (4, "inference", step), ev
    assert ev["groups_rescored"] == sorted(groups), ev
    assert pipe.ledger.owner(4) is Owner.FAILED and pipe.placement.inference == (3,)
    assert scored == clean[1]
    assert_same_training(clean[0], faulted)


@pytest.mark.slow
def test_an_inference_worker_found_dead_as_its_call_is_submitted_loses_no_group(out, clean):
    """Device 4's worker dies between calls: the submission of its next scoring call finds the process gone and
    raises before any call is made; the groups that call was to take stay queued and device 3 scores them, so
    the run ends like the run without the fault."""
    found: list[list[int]] = []

    def arm(pipe):
        inference = pipe.calls.inference
        score = inference.score

        def spy(device, groups):
            if device == 4 and not found:
                pid = pipe.group.pid(4)
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while process_alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.01)
                found.append([g.group_id for g in groups])
            return score(device, groups)
        inference.score = spy

    faulted, scored, pipe = _run(out, "inference-found-dead", arm)
    assert found
    (ev,) = [e for e in pipe.cluster.events if e["kind"] == "device_failed"]
    assert (ev["device"], ev["role"], ev["calls_lost"]) == (4, "inference", 0), ev
    assert pipe.ledger.owner(4) is Owner.FAILED and pipe.placement.inference == (3,)
    assert scored == clean[1]
    assert_same_training(clean[0], faulted)


@pytest.mark.slow
def test_a_replaced_rollout_device_rejoins_and_is_given_work_in_a_later_step(out, clean, tmp_path):
    """With cluster.replace_failed, instance 2's worker is killed in step 0; a replacement process starts, answers
    and the device goes FAILED -> FREE (`device_rejoined`); the step end puts it back in rollout and in step 1 it
    generates. The run ends like the run without the fault, and every fault is a row of the database."""
    killed: list[float] = []

    def arm(pipe):
        submit_slice, end_step = pipe.cluster.submit_slice, pipe.control.end_step

        def spy(device, groups, budget_s):
            f = submit_slice(device, groups, budget_s)
            if device == 2 and pipe.step_state.step == 0 and groups and not killed:
                killed.append(pipe.clock())
                _kill(pipe, 2)
            return f

        def back_before_the_step_ends(st):   # the run never waits for a replacement; this test does
            if st.step == 0:
                assert pipe.rejoin.wait(st.step, timeout_s=120) == [2] or pipe.ledger.owner(2) is Owner.FREE
            end_step(st)
        pipe.cluster.submit_slice, pipe.control.end_step = spy, back_before_the_step_ends

    engine = open_database(f"sqlite:///{tmp_path}/tidal.db")
    with session_scope(engine) as s:
        run_id = add_run(s, name="rejoin", config={}).id
    old_pid = []
    rejoined, scored, pipe = _run(out, "rollout-rejoins", lambda p: (old_pid.append(p.group.pid(2)), arm(p)),
                             ["cluster.replace_failed=true"], DbRecorder(engine, run_id, "static"))
    assert killed and scored == clean[1]
    assert_same_training(clean[0], rejoined)
    kinds = [(e["kind"], e["step"]) for e in pipe.cluster.events if e["kind"].startswith("device_")]
    assert kinds == [("device_failed", 0), ("device_recovered", 0), ("device_rejoined", 0)], kinds
    rejoined = next(e for e in pipe.cluster.events if e["kind"] == "device_rejoined")
    assert rejoined["pid"] == pipe.group.pid(2) != old_pid[0] and rejoined["bytes"] > 0, rejoined
    assert pipe.ledger.owner(2) is Owner.ROLLOUT and pipe.placement.rollout == (1, 2)
    step1 = pipe.timeline.steps[1][1]
    assert any(s.device == 2 and s.what == "generate" and s.t0 >= step1 for s in pipe.timeline.busy)
    (down,) = pipe.timeline.down
    assert (down.device, down.role) == (2, "rejoined") and abs(down.t1 - rejoined["time"]) < 0.5, down
    (rec,) = pipe.timeline.recovery
    assert rec.device == 2 and rec.what.startswith("recovery ")
    with session_scope(engine) as s:
        faults = [(f.kind, f.device_id, f.role, f.bytes > 0) for f in list_faults(s, run_id)]
        owners = [t.to_owner for t in list_transitions(s, run_id, device_id=2)]
    assert faults == [("failed", 2, "rollout", True), ("recovered", 2, "rollout", False),
                      ("rejoined", 2, "rollout", True)], faults
    assert owners[:4] == ["rollout", "failed", "free", "rollout"], owners


@pytest.mark.slow
def test_an_actor_worker_killed_during_a_checkpoint_write_stops_the_run_and_leaves_no_partial_checkpoint(out):
    """The actor's worker is killed as the checkpoint after step 1 is handed to it: the run stops on `WorkerDied`
    naming device 0 (an actor device is not recovered in place), the half-made generation is gone, the one before
    it is intact, and resuming from it ends with the weights the run had before the kill, bit for bit."""
    ckpt = out / "ckpt-killed" / "checkpoints"
    cfg = build_config(SMALL, [f"run.output_dir={out}", "run.name=ckpt-killed"])
    run = TrainingRun(cfg, out / "ckpt-killed")
    try:
        run.open()
        start = start_weights(run)
        run.step()
        first = run.checkpoint(ckpt)
        run.step()
        want = trained(run, start, final=run.pipe.global_weights())
        g = run.group
        submit_all = g.submit_all

        def spy(fn, *args, **kw):
            handles = submit_all(fn, *args, **kw)
            if fn is roles_ckpt.actor_save:
                os.kill(g.pid(0), signal.SIGKILL)
            return handles
        g.submit_all = spy   # type: ignore[method-assign]
        with pytest.raises(WorkerDied) as died:
            run.checkpoint(ckpt)
        assert died.value.device_id == 0
    finally:
        run.close()
    assert sorted(p.name for p in ckpt.iterdir()) == [first.name] and latest(ckpt) == first
    verify(first)
    assert_same_training(want, _resume(out, "ckpt-resumed", ckpt))


def _resume(out, name, ckpt) -> Trained:
    cfg = build_config(SMALL, [f"run.output_dir={out}", f"run.name={name}"])
    run = TrainingRun(cfg, out / name)
    try:
        run.open(resume_from=ckpt)
        start = start_weights(run)
        while run.next_step < cfg.run.num_steps:
            run.step()
        run.finish()
        return trained(run, start)
    finally:
        run.close()
