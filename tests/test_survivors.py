"""A device lost beyond what its step absorbs: the run carries on with the workers it has (tidal/pipeline/survivors.py).

The placement decision is checked on its own; then worker processes are killed with SIGKILL inside real runs (CPU
virtual devices, `actor.redundancy: host`, no checkpoint before the end) at the points a step cannot absorb: the
actor's iter, the actor's reshard onto a rollout device, and a checkpoint write. Each run goes on in the same
process with the same surviving workers (no worker started, the lost rank a hole in the world), from the host copy
kept after the last step, and ends with the weights of the run without the fault, bit for bit."""

import os
import signal

import pytest
from training_equality import PARITY_REWARD, assert_same_training, start_weights, trained

from tidal.core.config import build_config
from tidal.core.devices import Owner
from tidal.engine.layout import Layout
from tidal.pipeline.cluster import CallKind
from tidal.pipeline.run import TrainingRun
from tidal.pipeline.survivors import NoSurvivors, survivor_placement
from tidal.workers import roles, roles_ckpt
from tidal.workers.errors import WorkerDied, WorkerTimeout

pytestmark = pytest.mark.usefixtures("shared_ray")


def _fits(t: int) -> bool:
    return 4 % t == 0


def test_the_actor_keeps_its_surviving_devices_in_whole_tp_groups():
    p = survivor_placement(Layout(1, 2, (0, 1)), (2, 3), (4, 5), {0}, (), _fits)
    assert (p.layout, p.rollout, p.inference, p.borrowed, p.freed) == (Layout(1, 1, (1,)), (2, 3), (4, 5), (), ())
    # tp 2 x dp 2, one lost: one whole TP group survives; the odd survivor generates
    p = survivor_placement(Layout(2, 2, (0, 1, 2, 3)), (4,), (5,), {1}, (), _fits)
    assert (p.layout, p.rollout, p.freed) == (Layout(2, 1, (0, 2)), (3, 4), (3,))
    # an engine device lost: the actor is untouched
    p = survivor_placement(Layout(1, 2, (0, 1)), (2, 3), (4, 5), {3}, (), _fits)
    assert (p.layout, p.rollout, p.inference) == (Layout(1, 2, (0, 1)), (2,), (4, 5))


def test_without_a_whole_tp_group_the_actor_takes_free_then_rollout_then_inference_devices():
    # its only device lost: a free device first, else rollout's highest id, never rollout's last device
    assert survivor_placement(Layout(1, 1, (0,)), (1, 2), (3, 4), {0}, (5,), _fits).layout == Layout(1, 1, (5,))
    p = survivor_placement(Layout(1, 1, (0,)), (1, 2), (3, 4), {0}, (), _fits)
    assert (p.layout.devices, p.rollout, p.borrowed) == ((2,), (1,), (2,))
    p = survivor_placement(Layout(1, 1, (0,)), (1,), (3, 4), {0}, (), _fits)
    assert (p.layout.devices, p.rollout, p.inference) == ((4,), (1,), (3,))
    # tp 2 with one survivor: a borrowed device completes the TP group (devices in increasing order)
    p = survivor_placement(Layout(2, 1, (2, 3)), (0, 1), (4, 5), {3}, (), _fits)
    assert (p.layout, p.borrowed, p.rollout) == (Layout(2, 1, (1, 2)), (1,), (0,))
    # not enough spares for a TP 2 group: TP 1 on the survivor
    p = survivor_placement(Layout(2, 1, (2, 3)), (0,), (4,), {3}, (), _fits)
    assert (p.layout, p.borrowed) == (Layout(1, 1, (2,)), ())
    # a device that cannot hold an actor shard (a replacement outside the world) is never borrowed
    p = survivor_placement(Layout(1, 1, (0,)), (1, 2), (3,), {0}, (6,), _fits, actor_capable=lambda d: d != 6)
    assert p.layout.devices == (2,)


def test_the_survivors_cannot_continue_without_a_device_for_every_component():
    with pytest.raises(NoSurvivors, match="rollout has no device left"):
        survivor_placement(Layout(1, 1, (0,)), (1,), (2,), {1}, (), _fits)
    with pytest.raises(NoSurvivors, match="no device left for the actor"):
        survivor_placement(Layout(1, 1, (0,)), (1,), (2,), {0}, (), _fits)


# ---- real processes ---------------------------------------------------------------------------------------------
#: the actor data-parallel over two devices, two rollout instances, two inference devices; the scheduler on, so the
#: actor grows onto rollout devices as generation ends (a reshard to kill in); a host copy after every step
BASE = {
    "run": {"num_steps": 3, "seed": 5, "checkpoint_every": 0, "max_restarts": 1},
    "cluster": {"num_devices_per_node": 6, "component_placement": {"actor": "0-1", "rollout": "2-3",
                                                                    "inference": "4-5"},
                "auto_scheduler": True, "failure_timeout_s": 15},
    "scheduler": {"policy": "tidal"},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0, "redundancy": "host"},
    "rollout": {"max_new_tokens": 8, "max_running_requests": 4},
    "algorithm": {"group_size": 4, "n_minibatches": 2},
    "data": {"rollout_batch_size": 8, "eval_size": 8},
    "warm_start": {"iters": 0},
    "reward": {"function": PARITY_REWARD},   # the random model's groups are half rewarded: every iter trains
}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("survivors")


def _train(out, name, arm=None):
    """A run as `run_training` drives it (host copy before the first step and after each, `recover` on a loss),
    with `arm(run)` setting a fault up; returns (what it trained: `Trained`, the run, its pipeline's worker pids at
    start)."""
    cfg = build_config(BASE, [f"run.output_dir={out}", f"run.name={name}"])
    run = TrainingRun(cfg, out / name)
    try:
        run.open()
        start = start_weights(run)
        pids = {d: run.group.pid(d) for d in run.group.device_ids}
        if arm is not None:
            arm(run)
        run.keep_host_copy()
        while run.next_step < cfg.run.num_steps:
            try:
                run.step()
                if run.next_step < cfg.run.num_steps:
                    run.keep_host_copy()
            except (WorkerDied, WorkerTimeout) as failure:
                assert len(run.restarts) < cfg.run.max_restarts, failure
                run.recover(failure)
        run.checkpoint()
        run.finish()
        return trained(run, start), run, pids
    finally:
        run.close()
        run.drop_host_copy()


@pytest.fixture(scope="module")
def clean(out):
    ref, run, _ = _train(out, "clean")
    reshards = [e for e in run.pipe.cluster.events if e["kind"] == "reshard"]
    assert reshards   # the scheduler moves the actor: a reshard to kill in
    return ref


def _kill(pipe, device: int) -> None:
    os.kill(pipe.group.pid(device), signal.SIGKILL)


def _kill_on_call(killed: list[int], victim: int, when):
    """An `arm` for `_train`: SIGKILL `victim`'s worker once, right after the first call to any device for which
    `when(pipe, fn, kwargs)` holds is handed out (that device is appended to `killed`)."""
    def arm(run):
        pipe = run.pipe
        submit = pipe.group.submit

        def spy(device, fn, /, **kw):
            h = submit(device, fn, **kw)
            if not killed and when(pipe, fn, kw):
                killed.append(device)
                _kill(pipe, victim)
            return h
        pipe.group.submit = spy
    return arm


def _carried_on(run, pids, lost: int, more_lost_ok: bool = False) -> dict:
    """The one recovery: in place, same workers (no process started), the lost device FAILED and in no role.
    `more_lost_ok`: a survivor stuck after the loss may have been lost as well (then it too is out of the world)."""
    (rec,) = run.restarts
    assert rec["workers"] == "kept" and rec["source"] == "host copy", rec
    assert rec["device"] == lost and rec["steps_redone"] == 0, rec
    g = run.pipe.group
    now = {d: g.pid(d) for d in g.world_ids}
    before = {d: p for d, p in pids.items() if d != lost}
    if more_lost_ok:
        assert lost not in now and now.items() <= before.items() and now, (now, before)
    else:
        assert now == before
    assert run.pipe.ledger.owner(lost) is Owner.FAILED and lost not in run.pipe.placement.actor.devices
    return rec


@pytest.mark.slow
def test_an_actor_worker_killed_in_its_iter_costs_the_step_not_the_run(out, clean):
    killed = []

    def arm(run):
        pipe = run.pipe
        track = pipe.cluster.track

        def spy(kind, handle, payload=None):
            f = track(kind, handle, payload)
            device = handle.device_id
            if kind is CallKind.ACTOR and device == 0 and pipe.step_state.step == 1 and not killed:
                killed.append(pipe.clock())
                _kill(pipe, 0)
            return f
        pipe.cluster.track = spy

    survived, run, pids = _train(out, "actor-iter", arm)
    assert killed
    rec = _carried_on(run, pids, 0)
    assert (rec["layout_from"], rec["layout_to"]) == ("tp=1,dp=2,devices=0-1", "tp=1,dp=1,devices=1"), rec
    assert_same_training(clean, survived)


@pytest.mark.slow
def test_an_actor_worker_killed_in_a_reshard_costs_the_step_not_the_run(out, clean):
    """The actor's second worker killed as the tidal policy's reshard onto rollout devices is handed out."""
    killed: list[int] = []
    arm = _kill_on_call(killed, 1, lambda pipe, fn, kw: fn is roles.actor_reshard and pipe.step_state.step == 1)
    survived, run, pids = _train(out, "actor-reshard", arm)
    assert killed
    (rec,) = run.restarts
    assert rec["device"] == 1 and rec["source"] == "host copy" and rec["steps_redone"] == 0, rec
    # a survivor the kill leaves blocked in the reshard's collective (on a peer that gave up, not on the dead rank)
    # is lost after cluster.failure_timeout_s; when the others then cannot hold every component, every worker is
    # replaced. Either way the run ends as the run without the fault.
    if rec["workers"] == "kept":
        _carried_on(run, pids, 1, more_lost_ok=True)
    else:
        assert rec["workers"] == "replaced", rec
    assert_same_training(clean, survived)


@pytest.mark.slow
def test_an_actor_worker_killed_in_a_checkpoint_write_costs_the_step_not_the_run(out, clean):
    """The write of the host copy after step 1: its partial generation is removed, the run goes on from the copy
    kept after step 0 and runs step 1 again."""
    killed: list[int] = []
    arm = _kill_on_call(killed, 0, lambda pipe, fn, kw: fn is roles_ckpt.actor_save and kw["gen"] == 2)
    survived, run, _ = _train(out, "actor-ckpt", arm)
    assert killed
    (rec,) = run.restarts
    assert rec["workers"] == "kept" and rec["resumed_step"] == 1 and rec["steps_redone"] == 1, rec
    assert_same_training(clean, survived)
