"""The pipeline end to end on real device workers (Ray, gloo): records arrive whole and once, versions agree,
inference's old log-probs equal the actor's, and a dynamic run equals a static one bit for bit."""

import pytest
import torch

from tidal.config import build_config
from tidal.pipeline.run import TrainingRun
from tidal.scheduler.actions import LendToRollout, MigrateBatch, MigrateRequests, ReleaseRollout, ReshardActor
from tidal.scheduler.signals import ActorLayout

pytestmark = pytest.mark.slow

TINY = {
    "run": {"num_steps": 2, "seed": 3},
    "cluster": {"num_devices_per_node": 8, "component_placement": {"actor": "0-1", "rollout": "2-5",
                                                                    "inference": "6-7"}},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 16, "max_running_requests": 16},
    "algorithm": {"group_size": 4, "n_minibatches": 4},
    "data": {"rollout_batch_size": 16, "eval_size": 16},
    "warm_start": {"iters": 0},
}


def scripted(state, sig, now):
    """Three reshards and two migrations in every step, at fixed iter boundaries (same actions whatever the
    timing), through the real reconciler."""
    if sig.trigger == "start" and sig.step == 1:   # step 1: the actor's devices generate until rollout is done
        return [LendToRollout("script", devices=(0, 1), instance_ids=(0, 1))]
    if sig.trigger != "boundary" or not sig.actor.at_boundary or sig.actor.lent_out:
        return []   # lent: the driver trains nothing until the devices are back (it takes them when rollout ends)
    k, lay = sig.actor.iters_done, sig.actor.layout
    live = {r.id for r in sig.rollout}
    if k == 0 and 5 in live:
        # one migration wave with three exports from one source in flight at once (each takes the next groups)
        return [MigrateBatch("script", moves=((5, 4, 1), (5, 3, 1), (5, 4, 1 << 20)), kv=True),
                ReleaseRollout("script", instance_ids=(5,), devices=(5,), migrate_to=(4,)),
                ReshardActor("script", lay, ActorLayout(1, 3, (0, 1, 5)))]
    if k == 1 and 4 in live:
        return [MigrateRequests("script", src=4, dst=3, count=1 << 20),
                ReleaseRollout("script", instance_ids=(4,), devices=(4,), migrate_to=(3,)),
                ReshardActor("script", lay, ActorLayout(1, 4, (0, 1, 4, 5)))]
    if k == 2 and lay.dp == 4:
        return [ReshardActor("script", lay, ActorLayout(1, 3, (0, 1, 5)))]
    return []


def _check_inference_matches_actor(run):
    """After the weight sync, inference and actor hold the same weights: their log-probs agree bit for bit."""
    pipe = run.pipe
    groups = [g for g in pipe.step_state.scored.values()][:3]
    rescored = pipe.group.call(pipe.cluster.inference[0], "tidal.workers.roles:inference_score", groups=groups)
    handles = pipe.group.submit_all("tidal.workers.roles:actor_score", device_ids=pipe.cluster.actor_layout.devices,
                                    groups=groups)
    actor = next(r for r in pipe.group.gather(handles) if r is not None)
    assert all(g.inference_version == pipe.version for g in rescored)
    for g, mine in zip(rescored, actor):
        for a, b in zip(g.old_logprobs, mine):
            assert torch.equal(a, b)


def _run(tmp_path, name, overrides, policy=None):
    cfg = build_config(TINY, [f"run.output_dir={tmp_path}", f"run.name={name}", *overrides])
    run = TrainingRun(cfg, tmp_path / name)
    run.policy = policy
    try:
        run.open()
        versions, scored = [], []
        for _ in range(cfg.run.num_steps):
            run.step()
            st = run.pipe.step_state
            scored.append(sorted(st.scored))
            versions.append(run.pipe.version)
        _check_inference_matches_actor(run)
        summary = run.finish()
        return run, summary, scored, versions
    finally:
        run.close()


def test_dynamic_run_equals_static_run(tmp_path):
    static, s_sum, s_scored, s_versions = _run(tmp_path, "static", [])
    dynamic, d_sum, d_scored, d_versions = _run(tmp_path, "dynamic", ["cluster.auto_scheduler=true"], scripted)
    # every group of every step arrived whole and once, in both runs
    assert s_scored == d_scored == [list(range(16))] * 2
    assert s_versions == d_versions == [1, 2]
    events = dynamic.pipe.cluster.events
    for run in (static, dynamic):   # each iter is an event: layout, seconds and the slowest rank's phases
        iters = [e for e in run.pipe.cluster.events if e["kind"] == "iter"]
        assert [(e["step"], e["iter"]) for e in iters] == [(s, k) for s in range(2) for k in range(4)], iters
        for e in iters:
            assert set(e["phases_s"]) == {"compute", "sync", "update", "publish"}, e
            assert e["phases_s"]["compute"] > 0 and min(e["phases_s"].values()) >= 0, e
            assert 0 < e["phases_s"]["compute"] <= e["seconds"], e
    assert {e["dp"] for e in events if e["kind"] == "iter"} - {2}   # the dynamic run also trained at other sizes
    for step in range(2):
        kinds = [e["kind"] for e in events if e.get("step") == step]
        assert kinds.count("reshard") >= 3 and kinds.count("migration") >= 2, kinds
        assert all(e["ok"] for e in events if e["kind"] == "action")
        wave = [e for e in events if e["kind"] == "migration" and e.get("step") == step and e.get("wave") == 3]
        assert [e["src"] for e in wave] == [5, 5, 5], wave   # three exports from one source in one wave
    # step 1 lent the actor's devices at the start; nothing trained on them until the driver took them back
    lent = next(e["time"] for e in events if e["kind"] == "action" and e["action"] == "LendToRollout")
    back = [e for e in events if e["kind"] == "return_lent" and e.get("step") == 1]
    assert back and back[0]["reason"].startswith("rollout is done"), back
    trained_while_lent = [s for s in dynamic.pipe.timeline.busy
                          if s.role == "actor" and lent <= s.t0 < back[0]["time"]]
    assert not trained_while_lent, trained_while_lent
    # step 1 meets step 0's layouts again: its reshards involve only the actor's devices (rollout keeps going)
    scopes = [e["scope"] for e in events if e["kind"] == "reshard" and e.get("step") == 1]
    assert scopes and set(scopes) == {"members"}, scopes
    # every rank used the program the driver planned for it (the bitwise checks below cover its correctness)
    assert all(e["prepared"] for e in events if e["kind"] == "reshard")
    assert sum(e["requests"] for e in events if e["kind"] == "migration") > 0  # in-flight requests moved (KV)
    assert set(static.final_weights) == set(dynamic.final_weights)
    for name, w in static.final_weights.items():
        assert torch.equal(w, dynamic.final_weights[name]), name
    assert s_sum.reward_per_step == d_sum.reward_per_step
    assert s_sum.final_weights_sha == d_sum.final_weights_sha


def test_a_policy_that_keeps_failing_is_paused_for_the_step(tmp_path):
    """Every consult asks for a move the cluster cannot make (device 9 does not exist): each attempt fails and is
    rolled back, and after `MAX_FAILURES_PER_STEP` in a step the policy is not asked again until the step ends.
    The run completes on its placement and learns exactly what the static run learns."""
    from tidal.scheduler.reconciler import MAX_FAILURES_PER_STEP

    def stubborn(state, sig, now):
        lay = sig.actor.layout
        return [ReshardActor("impossible", lay, ActorLayout(1, 3, (0, 1, 9)))] if sig.trigger != "start" else []

    static, s_sum, _, _ = _run(tmp_path, "static", [])
    run, summary, _, versions = _run(tmp_path, "stubborn", ["cluster.auto_scheduler=true"], stubborn)
    events = run.pipe.cluster.events
    for step in range(2):
        failed = [e for e in events if e["kind"] == "action" and e.get("step") == step]
        assert failed and not any(e["ok"] for e in failed)
        assert len(failed) == MAX_FAILURES_PER_STEP, len(failed)
        assert [e["step"] for e in events if e["kind"] == "scheduler_paused"].count(step) == 1
    assert versions == [1, 2]
    assert summary.final_weights_sha == s_sum.final_weights_sha
