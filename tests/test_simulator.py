"""Simulator: determinism, conservation, idle fraction bounds, ledger safety, balanced work, the CLI entry."""

from __future__ import annotations

import dataclasses
import json
from argparse import Namespace

import pytest

from scheduler.sim_cli import cli_simulate
from scheduler.simulator import simulate
from scheduler.workload import LengthDist, SimSpec, rlinf_example


def small(prompts: int = 64, lengths: LengthDist | None = None, **flags) -> SimSpec:
    """RLinf's example shape with fewer prompts (fast): 8 devices, actor TP 2, 4 iters."""
    spec = rlinf_example(8, max_running_requests=128)
    params = dataclasses.replace(spec.params, rollout_batch_size=prompts, **flags)
    return dataclasses.replace(spec, params=params, lengths=lengths or spec.lengths, max_new_tokens=4096)


CASES = [("static", {}), ("rlinf", {}), ("rlinf", {"use_pre_process_policy": True}),
         ("rlinf", {"use_wait_before_last_iter_policy": True}), ("tidal", {})]


@pytest.mark.parametrize("policy,flags", CASES)
def test_conservation_and_bounds(policy, flags):
    spec = small(**flags)
    res = simulate(spec, policy, steps=3, seed=1)
    for st in res.steps:
        assert st.groups_generated == st.groups_scored == st.groups_trained == spec.params.rollout_batch_size
        assert 0.0 <= st.idle_fraction <= 1.0 and st.time_s > 0
    assert 0.0 <= res.idle_fraction <= 1.0
    assert res.total_s == pytest.approx(sum(s.time_s for s in res.steps))
    kinds = {e.kind for e in res.events}
    assert {"step_start", "iter_start", "iter_done", "step_end"} <= kinds
    json.dumps(res.to_json())


@pytest.mark.parametrize("policy", ["rlinf", "tidal"])
def test_deterministic_for_a_seed(policy):
    a = simulate(small(), policy, steps=2, seed=7).to_json()
    b = simulate(small(), policy, steps=2, seed=7).to_json()
    c = simulate(small(), policy, steps=2, seed=8).to_json()
    for d in (a, b, c):
        d.pop("sim_wall_s")
    assert a == b
    assert a["steps"] != c["steps"]


def test_dynamic_policies_move_devices_and_stay_contiguous_under_rlinf():
    res = simulate(small(prompts=128), "rlinf", steps=2, seed=0)
    reshards = [e for e in res.events if e.kind == "action" and e.detail.startswith("ReshardActor")]
    assert reshards, "the long tail should free rollout devices for the actor"
    assert sum(s.migrations for s in res.steps) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tidal_never_double_books(seed):
    """Every action goes through a DeviceLedger that refuses a device in two roles; a run completing with
    conservation is the property (IllegalTransition would abort it)."""
    spec = small(prompts=96, lengths=LengthDist(median=600, sigma=1.1, group_sigma=0.8))
    res = simulate(spec, "tidal", steps=3, seed=seed)
    assert all(s.groups_trained == 96 for s in res.steps)


@pytest.mark.parametrize("policy", ["rlinf", "tidal"])
def test_polling_asks_the_policy_while_the_actor_waits_as_the_driver_does(policy):
    """`SimSpec.poll_s`: the policy is asked again every poll_s while the actor waits at a boundary (the real
    reconciler's rate), on top of the events; work is conserved and static cannot tell the difference."""
    spec = small(prompts=96)
    polled = dataclasses.replace(spec, poll_s=2.0)
    a, b = simulate(spec, policy, steps=2, seed=3), simulate(polled, policy, steps=2, seed=3)
    assert sum(s.decisions for s in b.steps) > sum(s.decisions for s in a.steps)
    assert all(s.groups_trained == 96 for s in b.steps)
    assert simulate(polled, "static", steps=2, seed=3).total_s == simulate(spec, "static", steps=2, seed=3).total_s


def test_tidal_not_slower_than_static_on_balanced_work():
    balanced = LengthDist(median=1000, sigma=0.0, group_sigma=0.0)  # every response the same length
    spec = small(prompts=64, lengths=balanced)
    static = simulate(spec, "static", steps=2, seed=0)
    tidal = simulate(spec, "tidal", steps=2, seed=0)
    assert tidal.total_s <= static.total_s * 1.0001


def test_tidal_beats_static_on_the_long_tail():
    spec = small(prompts=128)
    assert simulate(spec, "tidal", steps=2, seed=0).total_s < simulate(spec, "static", steps=2, seed=0).total_s


def test_devices_flag_scales_the_example_placement():
    spec = rlinf_example(8).scaled(16)
    assert spec.params.actor_devices == tuple(range(4)) and spec.params.inference_devices == tuple(range(12, 16))
    with pytest.raises(Exception, match="multiple of 4"):
        rlinf_example(8).scaled(6)


def test_cli_simulate_writes_json(tmp_path, capsys):
    cfg = tmp_path / "sim.yaml"
    cfg.write_text("cluster:\n  auto_scheduler: true\n  device: cuda\n"
                   "  component_placement: {actor: 0-1, rollout: 2-5, inference: 6-7}\n"
                   "actor: {tensor_parallel_size: 2}\nmodel: {max_seq_len: 1280}\n"
                   "rollout: {max_new_tokens: 1024, max_running_requests: 64}\n"
                   "data: {rollout_batch_size: 32}\nalgorithm: {group_size: 8, n_minibatches: 4}\n")
    out = tmp_path / "r.json"
    rc = cli_simulate(Namespace(config=str(cfg), policy="all", devices=None, steps=2, seed=0, json=str(out)))
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["static", "rlinf", "tidal"]
    printed = capsys.readouterr().out
    assert "tidal" in printed and "static" in printed


# --- tidal's newer moves, exercised end to end (every action goes through the DeviceLedger) ---------------

def _action_kinds(res):
    kinds = {}
    for e in res.events:
        if e.kind == "action":
            k = e.detail.split()[0] + (" mid-step" if "waits for mini-batch" in e.detail else "")
            kinds[k] = kinds.get(k, 0) + 1
    return kinds


def test_tidal_lends_inference_and_lends_mid_step_with_conservation():
    # 32 slots per instance: 32 waves of 64 prompts x 16 over 4 instances, throughput-bound enough that lending
    # pays at the start and, while the actor waits for its next mini-batch (an id prefix, so a later wave), mid-step
    # too. (With 128 prompts, 16 waves, it does not pay mid-step: a lend speeds up only what the lent instances
    # generate until the mini-batch is scored, and imported sequences run first.)
    spec = rlinf_example(8, max_running_requests=32)
    spec = dataclasses.replace(spec, params=dataclasses.replace(spec.params, rollout_batch_size=256),
                               max_new_tokens=4096)
    res = simulate(spec, "tidal", steps=3, seed=0)
    kinds = _action_kinds(res)
    for k in ("LendInference", "ReturnToInference", "LendToRollout mid-step", "ReturnFromRollout"):
        assert kinds.get(k), (k, kinds)
    assert all(s.groups_trained == 256 for s in res.steps)
    assert "(kv)" in " ".join(e.detail for e in res.events if e.detail.startswith("Migrate"))


@pytest.mark.parametrize("devices,prompts", [(8, 64), (8, 256), (32, 128)])
def test_tidal_not_slower_than_static_on_balanced_work_at_several_sizes(devices, prompts):
    balanced = LengthDist(median=800, sigma=0.0, group_sigma=0.0)
    spec = dataclasses.replace(small(prompts=prompts, lengths=balanced).scaled(devices))
    spec = dataclasses.replace(spec, params=dataclasses.replace(spec.params, rollout_batch_size=prompts))
    static = simulate(spec, "static", steps=2, seed=0, keep_events=False)
    tidal = simulate(spec, "tidal", steps=2, seed=0, keep_events=False)
    assert tidal.total_s <= static.total_s * 1.0001


def test_shrink_with_start_rollout_then_release(monkeypatch):
    """A 4+-device actor shrinks to 2 mid-step; the 2 devices it leaves start rollout instances that take work
    and are released later (StartRollout + ReshardActor(shrink) through the ledger); tidal does the rest."""
    from scheduler import policies, policy_tidal
    from scheduler.actions import MigrateRequests, ReshardActor, StartRollout
    from scheduler.signals import ActorLayout
    done = []

    def shrinking(state, sig, now):
        a = sig.actor
        if not done and sig.trigger == "boundary" and a.layout.size >= 4 and a.iters_done < a.n_minibatches:
            done.append(sig.step)
            keep, leave = a.layout.devices[:2], a.layout.devices[2:]
            busiest = max(sig.rollout, key=lambda r: r.groups_unfinished)
            acts = [ReshardActor("test: shrink", a.layout, ActorLayout(2, 1, keep)),
                    StartRollout("test: start", leave, leave)]
            if busiest.groups_unfinished > 1:
                acts.append(MigrateRequests("test: fill", busiest.id, leave[0], busiest.groups_unfinished // 2))
            return acts
        return policy_tidal.decide(state, sig, now)

    monkeypatch.setitem(policies.POLICIES, "shrinking", shrinking)
    spec = small(prompts=128).scaled(16)
    spec = dataclasses.replace(spec, params=dataclasses.replace(spec.params, rollout_batch_size=256))
    res = simulate(spec, "shrinking", steps=2, seed=0)
    assert done, "the shrink never happened"
    assert any(e.detail.startswith("StartRollout") for e in res.events)
    assert all(s.groups_trained == 256 for s in res.steps)


def test_packed_snapshot_matches_per_instance_queries():
    """The vectorised snapshot (packed epochs of two batches, interleaved) equals per-instance scalar queries."""
    import numpy as np

    from scheduler.costs import gpu_h200_1p5b
    from scheduler.rollout_model import Instance, Packed, Work, lay_out
    rng = np.random.default_rng(3)
    dec = gpu_h200_1p5b().decode

    def works(k, g0):
        out = []
        for i in range(k):
            n = int(rng.integers(0, 5))
            gid = np.repeat(np.arange(g0 + 10 * i, g0 + 10 * i + n), 4)
            out.append(Work(gid, rng.integers(1, 300, gid.size).astype(float), rng.integers(0, 50, gid.size) * 1.0))
        return out
    a = lay_out(works(5, 0), list(rng.random(5)), 6, dec)
    b = lay_out(works(4, 1000), list(1 + rng.random(4)), 6, dec)
    insts = []
    for k, e in enumerate([a[0], b[0], a[1], a[2], b[1], b[2], a[3], b[3], a[4]]):
        inst = Instance(k, (k,), 6)
        inst.set_epoch(e)
        insts.append(inst)
    packed = Packed(insts, dec)
    for t in (0.0, 0.5, 1.2, 2.0, 3.5, 100.0):
        snap = packed.at(t)
        for k, inst in enumerate(insts):
            e = inst.e
            left = e.unfinished(t)
            assert snap["running"][k] == len(left)
            assert snap["tokens"][k] == pytest.approx(e.tokens(t), abs=1e-6)
            assert snap["groups_unfinished"][k] == sum(1 for g in e.gwall if g > t + 0.0)
            if len(left):
                assert snap["progress"][k] == pytest.approx(float(left.prog.sum()), abs=1e-6)


class _FixedLengths:
    """Response lengths chosen per group (every sample of group g gets lengths[g])."""

    def __init__(self, lengths):
        self.lengths = lengths

    def sample(self, rng, groups, group_size, max_new, step=0):
        import numpy as np
        return np.repeat(np.asarray(self.lengths, dtype=np.int64)[:groups, None], group_size, axis=1)


def _iter_starts(res, step=0):
    return [e.time for e in res.events if e.step == step and e.kind == "iter_start"]


def test_simulated_iters_train_id_prefixes_as_the_driver_does():
    """The driver trains iter k on groups [k*G/n, (k+1)*G/n) in id order and deals them round robin (its first
    wave holds the lowest ids). A straggler in group 0 therefore holds iter 0 back however many other groups are
    scored; with a straggler in the last group, iter 0 starts as soon as its own groups are through. (Counting any
    G/n scored groups would start iter 0 past a straggler in group 0.)"""
    spec = small(prompts=32)
    step_s = spec.costs.decode.step_s
    late = dataclasses.replace(spec, lengths=_FixedLengths([2000] + [50] * 31))
    early = dataclasses.replace(spec, lengths=_FixedLengths([50] * 31 + [2000]))
    t_late = _iter_starts(simulate(late, "static", steps=1, seed=0))
    t_early = _iter_starts(simulate(early, "static", steps=1, seed=0))
    assert len(t_late) == len(t_early) == 4
    assert t_late[0] >= 2000 * step_s              # iter 0 waited for group 0's 2,000 tokens
    assert t_early[0] < 200 * step_s               # its own 8 groups: one wave of 50 tokens, then scoring
    assert t_early[3] >= 2000 * step_s             # the last iter holds group 31


def test_simulated_signals_report_prefixes():
    """What the policy sees as generated / scored is the id prefix (the real control loop,
    tidal/pipeline/control.py, reports the same)."""
    from scheduler.simulator import _Sim
    spec = small(prompts=32)
    sim = _Sim(spec, "static", 0, keep_events=False)
    sim.run_step(0)
    sig = sim.signals("tick")
    assert sig.groups_generated == 32 and sig.inference.groups_finished == 32
    sim.scored_prefix, sim.gen_prefix = 3, 5
    sig = sim.signals("tick")
    assert sig.groups_generated == 5 and sig.inference.groups_finished == 3


def test_imported_sequences_run_before_the_targets_unstarted_ones(monkeypatch):
    """A migration's started sequences go first in the target's waiting queue, as the engine's `import_state`
    puts them, not after everything the target has queued."""
    from scheduler import policies
    from scheduler.actions import MigrateRequests
    from scheduler.simulator import _Sim
    moved = []

    def mover(state, sig, now):
        if not moved and sig.groups_generated >= 4:
            moved.append(now)
            return [MigrateRequests("test: move instance 2's groups", 2, 3, 3)]
        return []

    monkeypatch.setitem(policies.POLICIES, "mover", mover)
    spec = rlinf_example(8, max_running_requests=16)   # one group of 16 at a time per instance
    spec = dataclasses.replace(spec, params=dataclasses.replace(spec.params, rollout_batch_size=16),
                               lengths=_FixedLengths([100] * 16), max_new_tokens=4096, poll_s=0.05)
    sim = _Sim(spec, "mover", 0, keep_events=False)
    sim.run_step(0)
    assert moved
    # groups 0-3 end first (one wave); then instance 2 runs group 4 and holds 8, 12, instance 3 runs 5 and holds
    # 9, 13; the move lands 4 (started) ahead of 9 and 13, and 8, 12 (not started) behind them
    g = sim.gen_at
    assert max(g[:4]) < moved[0] < g[5] < g[4] < g[9] < g[13] < g[8] < g[12]


def test_fitted_h200_preset_simulates_the_rlinf_example(tmp_path):
    """`--costs gpu_h200` (fitted to H200 measurements) drives the same simulation; dynamic policies beat static."""
    from scheduler.costs import preset
    fitted = preset("gpu_h200")
    assert fitted.name == "gpu-h200" and fitted.decode.step_time(64) > fitted.decode.step_s > 0
    out = tmp_path / "sim.json"
    cli_simulate(Namespace(config="rlinf-example", policy="all", devices=None, steps=2, seed=0, json=str(out),
                           costs="gpu_h200"))
    res = {r["policy"]: r["mean_step_s"] for r in json.loads(out.read_text())}
    assert res["tidal"] < res["static"] and res["rlinf"] < res["static"]


def test_rlinf_wait_before_last_iter_changes_the_step_where_rollout_outlasts_the_iter():
    """The flag binds only when rollout still runs at the boundary before the last iter. On RLinf's example the
    2-device actor's first iters outlast the rollout tail, so the flag cannot change anything there; with the
    actor on 4 devices and 2 iters a step, the tail is still running at that boundary: the flag holds the actor
    (a recorded wait) until rollout ends, then hands it every device at once, and the step's time changes."""
    base = rlinf_example(8)
    steps = {}
    for flag in (False, True):
        p = dataclasses.replace(base.params, use_wait_before_last_iter_policy=flag, n_minibatches=2,
                                actor_devices=(0, 1, 2, 3), rollout_devices=(4, 5), inference_devices=(6, 7))
        r = simulate(dataclasses.replace(base, params=p), "rlinf", None, 2, 0)
        waits = sum("wait before last iter" in e.detail for e in r.events)
        assert (waits > 0) == flag
        steps[flag] = r.mean_step_s
    assert steps[True] != steps[False]
