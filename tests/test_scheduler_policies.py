"""Scheduler policies, table-driven: exact action sequences from hand-built signals (no cluster, no simulator)."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import policy_rlinf, policy_tidal
from scheduler.actions import (
    LendInference,
    LendToRollout,
    MigrateBatch,
    MigrateRequests,
    ReleaseInference,
    ReleaseRollout,
    ReshardActor,
    ReturnFromRollout,
    Wait,
)
from scheduler.costs import DecodeCost, fit_decode, fit_linear, gpu_h200_1p5b
from scheduler.estimate import LengthModel
from scheduler.signals import (
    ActorLayout,
    ActorSignal,
    DeviceSignal,
    InferenceSignal,
    RolloutColumns,
    RolloutInstanceSignal,
    RolloutView,
    Signals,
)
from scheduler.state import PolicyParams, SchedState
from scheduler.workload import rlinf_example
from tidal.core.config import ClusterConfig, build_config
from tidal.core.devices import Owner
from tidal.core.errors import ConfigError

P8 = rlinf_example(8).params   # actor 0-1 TP2, rollout 2-5 TP1, inference 6-7, 512 x 16, 4 iters, M=512
L2 = ActorLayout(2, 1, (0, 1))


def inst(i, running, groups, lent=False, est=None, rate=20_000.0):
    return RolloutInstanceSignal(id=i, devices=(i,), groups_queued=0, groups_unfinished=groups, running=running,
                                 total=2048, tokens_generated=0, progress_tokens=running * 500, token_rate=rate,
                                 est_remaining_tokens=running * 800.0 if est is None else est, lent=lent)


def sig(rollout, *, iters=1, layout=L2, inf_done=False, inf_devices=(6, 7), free=(), trigger="boundary",
        held=False, lent_out=False, generated=256, scored=200):
    owners = [Owner.FREE] * 8
    for d in layout.devices:
        owners[d] = Owner.ACTOR
    for r in rollout:
        for d in r.devices:
            owners[d] = Owner.ROLLOUT
    for d in inf_devices:
        owners[d] = Owner.INFERENCE
    for d in free:
        owners[d] = Owner.FREE
    return Signals(time=100.0, step=0, rollout=tuple(rollout),
                   inference=InferenceSignal(inf_devices, 0, scored, inf_done),
                   actor=ActorSignal(iters, 4, True, layout, 30.0, lent_out, held),
                   devices=DeviceSignal(tuple(owners)), groups_total=512, groups_generated=generated,
                   trigger=trigger)


def state(**flags):
    return SchedState(dataclasses.replace(P8, **flags), gpu_h200_1p5b(), 1700.0, 256.0)


WHY_700 = "running 700 fits in 2 of 4 instances; actor size 4 absorbs 2 (lowest ids first)"

RLINF_CASES = [
    ("worked example: 2 instances go, lowest ids, actor 2 -> 4 (contiguous)",
     {}, sig([inst(2, 400, 25), inst(3, 100, 7), inst(4, 100, 8), inst(5, 100, 6)]),
     [MigrateRequests(WHY_700, 2, 4, 16), MigrateRequests(WHY_700, 2, 5, 9), MigrateRequests(WHY_700, 3, 5, 7),
      ReleaseRollout(WHY_700, (2, 3), (2, 3), (4, 5)),
      ReshardActor("largest valid size with 2 free devices is 4", L2, ActorLayout(2, 2, (0, 1, 2, 3)))]),
    ("leftover: one instance could go but size 4 needs 2 devices: nothing moves, the device idles",
     {}, sig([inst(2, 400, 9), inst(3, 400, 9), inst(4, 400, 9), inst(5, 100, 3)]), []),
    ("leftover: a free device that cannot form a valid size stays idle",
     {}, sig([inst(3, 500, 9), inst(4, 500, 9), inst(5, 500, 9)], free=(2,)), []),
    ("not an iter boundary: RLinf does nothing",
     {}, sig([inst(2, 100, 5), inst(3, 0, 0), inst(4, 0, 0), inst(5, 0, 0)], trigger="drain"), []),
    ("rollout done and inference done: everything to the actor, largest valid size 8",
     {}, sig([inst(2, 0, 0), inst(3, 0, 0), inst(4, 0, 0), inst(5, 0, 0)], iters=3, inf_done=True),
     [ReleaseRollout("rollout finished: running_tasks == 0", (2, 3, 4, 5), (2, 3, 4, 5)),
      ReleaseInference("inference finished", (6, 7)),
      ReshardActor("largest valid size with 6 free devices is 8", L2, ActorLayout(2, 4, tuple(range(8))))]),
    ("wait-before-last-iter: after iter n-2 the actor waits for rollout",
     {"use_wait_before_last_iter_policy": True},
     sig([inst(2, 10, 1), inst(3, 0, 0), inst(4, 0, 0), inst(5, 0, 0)], iters=3),
     [Wait("wait before last iter: 10 tasks still running")]),
    ("wait-before-last-iter: rollout done, inference not: wait for inference",
     {"use_wait_before_last_iter_policy": True},
     sig([inst(2, 0, 0), inst(3, 0, 0), inst(4, 0, 0), inst(5, 0, 0)], iters=3, held=True, trigger="drain"),
     [ReleaseRollout("rollout finished: running_tasks == 0", (2, 3, 4, 5), (2, 3, 4, 5)),
      Wait("wait before last iter: inference not finished")]),
    ("without the flag: rollout released, inference not done, actor to 4 (no wait)",
     {}, sig([inst(2, 0, 0), inst(3, 0, 0), inst(4, 0, 0), inst(5, 0, 0)], iters=3),
     [ReleaseRollout("rollout finished: running_tasks == 0", (2, 3, 4, 5), (2, 3, 4, 5)),
      ReshardActor("largest valid size with 4 free devices is 4", L2, ActorLayout(2, 2, (0, 1, 2, 3)))]),
    ("step end: back to the initial layout",
     {}, sig([inst(4, 0, 0), inst(5, 0, 0)], iters=4, layout=ActorLayout(2, 2, (0, 1, 2, 3)), inf_devices=()),
     [ReshardActor("step end: actor returns to its initial layout", ActorLayout(2, 2, (0, 1, 2, 3)), L2)]),
    ("pre-process at step start: the actor's devices become rollout instances 0 and 1",
     {"use_pre_process_policy": True}, sig([inst(2, 0, 0)], iters=0, trigger="start"),
     [LendToRollout("pre-process: the actor's devices run rollout until the step's work thins out",
                    devices=(0, 1), instance_ids=(0, 1))]),
]


@pytest.mark.parametrize("name,flags,signals,expected", RLINF_CASES, ids=[c[0][:40] for c in RLINF_CASES])
def test_rlinf_exact_actions(name, flags, signals, expected):
    assert policy_rlinf.decide(state(**flags), signals, signals.time) == expected


def _lent_sig(running_lent, running_other, trigger="tick"):
    ro = [inst(0, running_lent, 4, lent=True), inst(1, running_lent, 4, lent=True)]
    ro += [inst(i, running_other, 5) for i in (2, 3, 4, 5)]
    ro = [dataclasses.replace(r, total=1000) for r in ro]
    return sig(ro, iters=0, trigger=trigger, lent_out=True)


def test_rlinf_pre_process_polls_then_hands_back():
    st = state(use_pre_process_policy=True)
    # 6 x 1000 total tasks, 2 x 900 + 4 x 900 running > half: keep polling every second
    assert policy_rlinf.decide(st, _lent_sig(900, 900), 0.0) == [
        Wait("pre-process: running 5400 > 0.5 x 6000 tasks", recheck_s=1.0)]
    # between polls RLinf does not look even if the condition holds
    assert policy_rlinf.decide(st, _lent_sig(100, 100, trigger="data_ready"), 0.0) == [
        Wait("pre-process: between polls")]
    why = "pre-process: running 600 <= 0.5 x 6000 tasks; hand the actor's devices back"
    assert policy_rlinf.decide(st, _lent_sig(100, 100), 0.0) == [
        MigrateRequests(why, 0, 2, 2), MigrateRequests(why, 0, 3, 2), MigrateRequests(why, 1, 4, 2),
        MigrateRequests(why, 1, 5, 2), ReturnFromRollout(why, (0, 1), (0, 1), (2, 3, 4, 5))]


def test_tidal_knobs_come_from_the_scheduler_config():
    base = {"cluster": {"auto_scheduler": True}}
    p = PolicyParams.from_config(build_config(base, []))
    # defaults: config and PolicyParams agree
    assert (p.margin_s, p.margin_frac, p.grow_on_return, p.lend_actor, p.return_on_generated) == (
        0.0, 0.01, True, True, True)
    assert (PolicyParams.margin_s, PolicyParams.margin_frac, PolicyParams.grow_on_return, PolicyParams.lend_actor,
            PolicyParams.return_on_generated) == (
        p.margin_s, p.margin_frac, p.grow_on_return, p.lend_actor, p.return_on_generated)
    p = PolicyParams.from_config(build_config(base, ["scheduler.margin_s=0", "scheduler.grow_on_return=false",
                                                     "scheduler.lend_actor=false",
                                                     "scheduler.return_on_generated=false"]))
    assert (p.margin_s, p.grow_on_return, p.lend_actor, p.return_on_generated) == (0.0, False, False, False)
    with pytest.raises(ConfigError, match="scheduler.margin_s"):
        build_config(base, ["scheduler.margin_s=-1"])
    with pytest.raises(ConfigError, match="scheduler.margin_frac"):
        build_config(base, ["scheduler.margin_frac=1.5"])


def test_flags_omitted_have_one_source():
    """RLinf's trap (scheduler defaults True, workers False) cannot exist: the policy reads the config."""
    cfg = build_config({"cluster": {"auto_scheduler": True}})
    params = PolicyParams.from_config(cfg)
    workers_view = cfg.cluster  # what workers read
    for flag in ("use_pre_process_policy", "use_wait_before_last_iter_policy"):
        assert getattr(params, flag) is getattr(workers_view, flag) is ClusterConfig.model_fields[flag].default
        field = next(f for f in dataclasses.fields(PolicyParams) if f.name == flag)
        assert field.default is dataclasses.MISSING, "a second default would reintroduce the trap"
    st = SchedState(params)
    start = sig([inst(2, 0, 0)], iters=0, trigger="start")
    assert policy_rlinf.decide(st, start, 0.0) == []  # no lend: same as the workers' False
    cfg_on = build_config({"cluster": {"auto_scheduler": True, "use_pre_process_policy": True}})
    assert PolicyParams.from_config(cfg_on).use_pre_process_policy is True


def test_valid_sizes():
    assert P8.rlinf_sizes() == (2, 4, 8)
    assert P8.tidal_sizes() == (2, 4, 6, 8)


def test_tidal_releases_least_loaded_not_lowest_id():
    """Instance 5 is drained and 4 nearly: they go (their 2 groups to 2 and 3), not the lowest ids 2 and 3."""
    ro = [inst(2, 500, 30, est=500 * 3000.0), inst(3, 400, 25, est=400 * 2500.0),
          inst(4, 20, 2, est=20 * 2000.0), inst(5, 0, 0)]
    acts = policy_tidal.decide(state(), sig(ro, iters=1), 100.0)
    rel = [a for a in acts if isinstance(a, ReleaseRollout)]
    assert rel and rel[0].instance_ids[0] == 5, acts
    assert 2 not in rel[0].instance_ids
    resh = [a for a in acts if isinstance(a, ReshardActor)]
    assert resh and set(resh[0].to_layout.devices) >= set(L2.devices)
    owners = dict(enumerate(sig(ro).devices.owners))
    for d in set(resh[0].to_layout.devices) - set(L2.devices):  # joins only devices freed in this decision
        assert owners[d] is Owner.FREE or d in rel[0].devices


def test_tidal_uses_any_dp():
    """The actor has data waiting; one instance is still busy: 3 drained instances + 2 inference devices join
    a 2-device actor as 6 devices (dp 3), a size RLinf cannot use."""
    ro = [inst(2, 0, 0), inst(3, 0, 0), inst(4, 0, 0), inst(5, 200, 10, est=200 * 3000.0, rate=60_000)]
    acts = policy_tidal.decide(state(), sig(ro, iters=1, inf_done=True, generated=502, scored=490), 100.0)
    resh = next(a for a in acts if isinstance(a, ReshardActor))
    assert resh.to_layout.dp == 3 and 5 not in resh.to_layout.devices


def test_tidal_does_nothing_when_nothing_pays():
    ro = [inst(i, 500, 30, est=500 * 6000.0) for i in (2, 3, 4, 5)]  # rollout-bound: keep it whole
    assert policy_tidal.decide(state(), sig(ro, iters=1, scored=300), 100.0) == []  # data ready: no lend


def test_fit_recovers_linear_costs():
    samples = [(b, 0.004 + 30e-6 * b) for b in (1, 8, 64, 256, 512)]
    a, c = fit_linear(samples)
    assert a == pytest.approx(0.004) and c == pytest.approx(30e-6)
    d = fit_decode(samples, 6e-6)
    assert d.step_time(100) == pytest.approx(0.004 + 30e-6 * 100)
    with pytest.raises(Exception, match="two or more distinct"):
        fit_linear([(4, 1.0), (4, 1.1)])


def test_length_model_residual_grows_in_the_tail():
    m = LengthModel.fit([100] * 90 + [4000] * 10, max_new_tokens=8192)
    assert m.residual(0) == pytest.approx(490.0)
    assert m.residual(200) > 3000  # past 100 tokens only the long ones are left
    assert LengthModel.prior(1024).residual(0) == pytest.approx(512.0)


# --- tidal, table-driven: exact action sequences (fields; reasons are prose and checked only where quoted) ---

#: readiness curve and iter token shares as the producer learns them from a long-tailed step
CURVE = (0, .2, .3, .36, .45, .5, .55, .6, .63, .67, .7, .73, .77, .8, .85, .9, 1.0)


def lstate(**flags):
    return dataclasses.replace(state(**flags), ready_curve=CURVE, iter_shares=(0.16, 0.24, 0.28, 0.32))


def tinst(i, running, groups, est, tail, lent=False):
    return dataclasses.replace(inst(i, running, groups, lent=lent, est=est), est_tail_tokens=tail)


def fields(acts):
    """Action fields without the prose reason; a MigrateBatch is listed as its moves (as MigrateRequests)."""
    acts = [m for a in acts for m in (a.expand() if isinstance(a, MigrateBatch) else [a])]
    return [(type(a).__name__, {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name != "reason"})
            for a in acts]


def M(src, dst, count, kv=True):
    return ("MigrateRequests", {"src": src, "dst": dst, "count": count, "kv": kv})


def _inf_lent(generated, rollout):
    s = sig(rollout, iters=0, trigger="tick", generated=generated, scored=0, lent_out=True, inf_devices=())
    return dataclasses.replace(s, inference=InferenceSignal((), generated, 0, False, (6, 7)))


FULL = [tinst(i, 2048, 128, 2048 * 1700.0, 8000.0) for i in (2, 3, 4, 5)]
EARLY = [tinst(i, 1900, 120, 1900 * 1500.0, 7000.0) for i in range(8)]
LATE = [tinst(i, 600, 40, 600 * 900.0, 5000.0, lent=i in (0, 1)) for i in range(8)]
RETURNING = ([tinst(0, 300, 30, 300 * 1500.0, 6000.0, True), tinst(1, 300, 30, 300 * 1500.0, 6000.0, True)]
             + [tinst(i, 450, 60, 450 * 2500.0, 6000.0) for i in (2, 3, 4, 5)])
RETURNING_LATE = ([tinst(0, 20, 4, 20 * 900.0, 3000.0, True), tinst(1, 20, 4, 20 * 900.0, 3000.0, True)]
                  + [tinst(i, 30, 4, 30 * 900.0, 3000.0) for i in (2, 3, 4, 5)])
BUSY = [tinst(i, 500, 30, 500 * 6000.0, 7000.0) for i in (2, 3, 4, 5)]
SKEWED = [tinst(2, 400, 40, 400 * 4000.0, 7000.0), tinst(3, 0, 0, 0.0, 0.0), tinst(4, 100, 10, 100 * 1000.0, 2000.0),
          tinst(5, 300, 30, 300 * 3000.0, 6000.0)]


def _between(rollout):
    s = sig(rollout, iters=1, scored=300, trigger="drain")
    return dataclasses.replace(s, actor=ActorSignal(1, 4, False, L2, 30.0))


TIDAL_CASES = [
    ("step start: actor idle ~59s and inference ~39s before the first mini-batch: both lent, poll the backlog",
     {}, sig(FULL, iters=0, trigger="start", generated=0, scored=0),
     [("LendToRollout", {"devices": (0, 1), "instance_ids": (0, 1)}),
      ("LendInference", {"devices": (6, 7), "instance_ids": (6, 7)}),
      ("Wait", {"recheck_s": 1.0})]),
    ("inference lent, next mini-batch ~56s away, backlog ~2s: keep lending, recheck half-way (~27s)",
     {}, _inf_lent(5, EARLY), [("Wait", {"recheck_s": pytest.approx(27.2485, abs=1e-3)})]),
    ("inference lent, 110 groups waiting: it returns, its groups go to the non-lent instances by KV copy",
     {}, _inf_lent(110, LATE),
     [M(6, 2, 10), M(6, 3, 10), M(6, 4, 10), M(6, 5, 10), M(7, 2, 10), M(7, 3, 10), M(7, 4, 10), M(7, 5, 10),
      ("ReturnToInference", {"instance_ids": (6, 7), "devices": (6, 7), "migrate_to": (2, 3, 4, 5)})]),
    ("first mini-batch scored: lent devices return, groups spread over the least-loaded instances",
     {}, sig(RETURNING, iters=0, trigger="data_ready", generated=140, scored=128, lent_out=True),
     [M(0, 2, 8), M(0, 3, 8), M(0, 4, 8), M(0, 5, 6), M(1, 2, 8), M(1, 3, 8), M(1, 4, 8), M(1, 5, 6),
      ("ReturnFromRollout", {"instance_ids": (0, 1), "devices": (0, 1), "migrate_to": (2, 3, 4, 5)})]),
    ("first mini-batch scored late (480 of 512 groups generated): the lent devices return, 2 instances go and "
     "the actor grows to 4 at once; what both hold goes straight to the survivors in one batch (one drain)",
     {}, sig(RETURNING_LATE, iters=0, trigger="data_ready", generated=480, scored=128, lent_out=True),
     [M(0, 4, 1), M(0, 5, 1), M(0, 4, 1), M(0, 5, 1), M(1, 4, 1), M(1, 5, 1), M(1, 4, 1), M(1, 5, 1),
      M(2, 4, 1), M(2, 5, 1), M(2, 4, 1), M(2, 5, 1), M(3, 4, 1), M(3, 5, 1), M(3, 4, 1), M(3, 5, 1),
      ("ReturnFromRollout", {"instance_ids": (0, 1), "devices": (0, 1), "migrate_to": (4, 5)}),
      ("ReleaseRollout", {"instance_ids": (2, 3), "devices": (2, 3), "migrate_to": (4, 5)}),
      ("ReshardActor", {"from_layout": L2, "to_layout": ActorLayout(2, 2, (0, 1, 2, 3))})]),
    ("same with scheduler.grow_on_return off: only the return; the next boundary decides the rest",
     {"grow_on_return": False},
     sig(RETURNING_LATE, iters=0, trigger="data_ready", generated=480, scored=128, lent_out=True),
     [M(0, 2, 1), M(0, 3, 1), M(0, 4, 1), M(0, 5, 1), M(1, 2, 1), M(1, 3, 1), M(1, 4, 1), M(1, 5, 1),
      ("ReturnFromRollout", {"instance_ids": (0, 1), "devices": (0, 1), "migrate_to": (2, 3, 4, 5)})]),
    ("first mini-batch generated, not yet scored: the lent devices return now, the moves overlap its scoring",
     {}, sig(RETURNING, iters=0, trigger="boundary", generated=128, scored=120, lent_out=True),
     [M(0, 2, 8), M(0, 3, 8), M(0, 4, 8), M(0, 5, 6), M(1, 2, 8), M(1, 3, 8), M(1, 4, 8), M(1, 5, 6),
      ("ReturnFromRollout", {"instance_ids": (0, 1), "devices": (0, 1), "migrate_to": (2, 3, 4, 5)})]),
    ("same with scheduler.return_on_generated off: the lent instances keep generating until it is scored",
     {"return_on_generated": False}, sig(RETURNING, iters=0, trigger="boundary", generated=128, scored=120,
                                         lent_out=True), []),
    ("mid-step lending: the actor waits for mini-batch 1, rollout is throughput-bound: lend, balance by tokens",
     {}, sig(BUSY, iters=1, generated=200, scored=200),
     [("LendToRollout", {"devices": (0, 1), "instance_ids": (0, 1)}),
      M(2, 0, 10), M(3, 0, 10), M(4, 1, 10), M(5, 1, 10)]),
    ("same, with a churn margin (scheduler.margin_s) larger than any predicted gain: nothing moves",
     {"margin_s": 1e4}, sig(BUSY, iters=1, generated=200, scored=200), []),
    ("same, with a relative margin (scheduler.margin_frac) near the whole predicted step: nothing moves",
     {"margin_s": 0.0, "margin_frac": 0.99}, sig(BUSY, iters=1, generated=200, scored=200), []),
    ("same with scheduler.lend_actor off: the actor keeps its devices", {"lend_actor": False},
     sig(BUSY, iters=1, generated=200, scored=200), []),
    ("same, but the engine cannot move KV caches: re-prefill makes lending not pay",
     {"kv_migration": False}, sig(BUSY, iters=1, generated=200, scored=200), []),
    ("the mini-batch is generated, only its scores are pending: a lend would come straight back, none",
     {}, sig(BUSY, iters=1, generated=256, scored=200), []),
    ("rollout-bound and the actor has data: nothing pays", {}, sig(BUSY, iters=1, scored=300), []),
    ("between boundaries: heaviest instances hand groups to the lightest (KV copy)",
     {}, _between(SKEWED), [M(2, 3, 20), M(5, 4, 11)]),
    ("between boundaries without KV moves: same pairs, re-prefill migrations",
     {"kv_migration": False}, _between(SKEWED), [M(2, 3, 20, False), M(5, 4, 11, False)]),
    ("step end: back to the initial layout", {},
     sig([inst(4, 0, 0)], iters=4, layout=ActorLayout(2, 2, (0, 1, 2, 3)), inf_devices=()),
     [("ReshardActor", {"from_layout": ActorLayout(2, 2, (0, 1, 2, 3)), "to_layout": L2})]),
]


@pytest.mark.parametrize("name,flags,signals,expected", TIDAL_CASES, ids=[c[0][:40] for c in TIDAL_CASES])
def test_tidal_exact_actions(name, flags, signals, expected):
    got = fields(policy_tidal.decide(lstate(**flags), signals, signals.time))
    assert [(t, {k: v for k, v in f.items() if k in e}) for (t, f), (_, e) in zip(got, expected)] == expected
    assert [t for t, _ in got] == [t for t, _ in expected]


def test_tidal_start_reason_names_the_prediction():
    acts = policy_tidal.decide(lstate(), sig(FULL, iters=0, trigger="start", generated=0, scored=0), 0.0)
    assert acts[0] == LendToRollout("actor idle until its first mini-batch (~59s): lending saves ~20s of rollout "
                                    "for ~2.6s of lend/return/migration", devices=(0, 1), instance_ids=(0, 1))
    assert isinstance(acts[1], LendInference) and isinstance(acts[2], Wait)


def test_tidal_same_decision_from_records_or_columns():
    """A producer may pass columns (the simulator) or records only (a plain reconciler): same actions."""
    for s in (sig(BUSY, iters=1, generated=200, scored=200), _between(SKEWED), _inf_lent(110, LATE)):
        cols = RolloutColumns.of(s.rollout)
        with_cols = dataclasses.replace(s, columns=cols)
        view = dataclasses.replace(s, rollout=RolloutView(cols, [r.devices for r in s.rollout]), columns=cols)
        assert view.rollout == s.rollout
        expected = policy_tidal.decide(lstate(), s, 0.0)
        assert policy_tidal.decide(lstate(), with_cols, 0.0) == expected
        assert policy_tidal.decide(lstate(), view, 0.0) == expected


def test_inst_seconds_is_steps_times_step_cost_plus_tokens_times_per_seq():
    st = lstate()
    d = st.costs.decode
    cols = RolloutColumns.of(tuple(SKEWED))
    got = policy_tidal.inst_seconds(st, cols)
    assert got[1] == 0.0   # drained
    assert got[0] == pytest.approx(d.step_s * 7000 + d.per_seq_s * 400 * 4000)  # tail-bound (7000 > 1.6M/512)


def test_length_model_tail_grows_with_the_number_of_sequences():
    m = LengthModel.fit(list(range(1, 1001)), max_new_tokens=1024)
    import numpy as np
    one, many = m.tail_many(np.array([1, 255]), np.array([0.0, 0.0]), np.array([0, 0]))
    assert one < many <= 1000
    assert m.tail_many(np.array([0]), np.array([0.0]), np.array([0]))[0] == 0.0


def test_tidal_does_not_ping_pong_a_straggler():
    """Flat decode cost (CPU workers): an instance whose time is its longest sequence gains nothing by handing
    groups away (the moved groups may carry that sequence); the same instance with more work than its slots run
    at once does hand groups to the idle one. Measured before the fix: one tail group moved 8 times in a step."""
    import numpy as np

    from scheduler.costs_cpu import cpu_e2e
    st = SchedState(dataclasses.replace(P8, max_running_requests=16, group_size=8), cpu_e2e(), 20.0, 10.0)
    light = [tinst(3, 1, 1, 5.0, 5.0), tinst(4, 2, 1, 10.0, 8.0), tinst(5, 2, 1, 12.0, 9.0)]
    tail_bound = _between([tinst(2, 10, 3, 10 * 25.0, 48.0)] + light)
    assert policy_tidal._rebalance(st, tail_bound, np.ones(4, bool)) == []
    busy = _between([tinst(2, 60, 8, 60 * 25.0, 48.0)] + light)
    moves = [m for a in policy_tidal._rebalance(st, busy, np.ones(4, bool)) for m in a.expand()]
    assert [(m.src, m.dst) for m in moves] == [(2, 3)] and moves[0].count >= 1


def test_tidal_inference_returns_by_the_groups_waiting_not_the_generated_prefix():
    """Inference lent, group 2 still running (the id-order prefix of generated groups is 2) while 150 groups wait
    to be scored: scoring them takes about as long as the rest of rollout, so inference comes back now. With the
    prefix as the backlog (before the fix) it waited, and on the CPU e2e run scored 30 groups after rollout."""
    mid = [tinst(i, 300, 30, 300 * 800.0, 2500.0) for i in range(8)]
    out = {}
    for waiting in (2, 150):
        s = sig(mid, iters=0, trigger="tick", generated=2, scored=0, lent_out=True, inf_devices=())
        s = dataclasses.replace(s, inference=InferenceSignal((), waiting, 0, False, (6, 7)))
        out[waiting] = [type(a).__name__ for a in policy_tidal.decide(lstate(), s, s.time)]
    assert out == {2: ["Wait"], 150: ["MigrateBatch", "ReturnToInference"]}


def test_tidal_keeps_one_instance_when_what_is_left_fits_its_slots():
    """110 sequences left over 4 instances of 512 slots: keeping only the busiest one and growing the actor onto
    the other 3 beats the doubling grid's best (release 2). Seen on the CPU e2e run: 1 sequence left on 4
    instances, 2 released, the actor trained its remaining iters at DP 4 instead of 7."""
    layout = ActorLayout(1, 2, (0, 1))
    rollout = [tinst(2, 100, 13, 100 * 300.0, 900.0), tinst(3, 5, 1, 5 * 200.0, 400.0),
               tinst(4, 3, 1, 3 * 200.0, 300.0), tinst(5, 2, 1, 2 * 150.0, 200.0)]
    s = sig(rollout, iters=1, scored=300, trigger="boundary", generated=500, layout=layout)
    got = fields(policy_tidal.decide(lstate(actor_tp=1), s, s.time))
    assert got == [M(5, 2, 1), M(3, 2, 1), M(4, 2, 1),
                   ("ReleaseRollout", {"instance_ids": (5, 3, 4), "devices": (5, 3, 4), "migrate_to": (2,)}),
                   ("ReshardActor", {"from_layout": layout, "to_layout": ActorLayout(1, 5, (0, 1, 3, 4, 5))})]


def test_rollout_time_counts_the_last_wave():
    """An instance with full slots turns out tokens / slots steps, then drains its last wave (up to the longest
    sequence); a tail-bound one takes its longest sequence. 128 slots, 1 ms per step here."""
    st = SchedState(dataclasses.replace(P8, max_running_requests=128),
                    dataclasses.replace(gpu_h200_1p5b(), decode=DecodeCost(step_s=1e-3, per_seq_s=0.0,
                                                                           prefill_per_token_s=0.0)))
    assert st.decode_seconds(128 * 1000.0, 300.0) == pytest.approx((1000 + 300) * 1e-3)   # throughput-bound
    assert st.decode_seconds(128 * 100.0, 300.0) == pytest.approx(300 * 1e-3)             # the tail bounds it
    assert st.decode_seconds(128 * 200.0, 300.0) == pytest.approx(400 * 1e-3)             # half a wave left
    assert P8.micro_batches == 0 and dataclasses.replace(P8, micro_batch_size=64).micro_batches == 32


def test_tidal_reads_rollout_progress_from_tokens_when_the_prefix_stalls():
    """Group 0 still runs (generated prefix 0) but 87% of the step's tokens are generated: by the learned curve the
    first mini-batch is due now (not 45% of the rollout away, as the prefix alone said), and once its sequences
    all run it is ready no sooner than their longest remaining one."""
    from scheduler.policy_tidal import _timeline
    st = lstate()
    late = [tinst(i, 500, 30, 500 * 900.0, 3000.0) for i in (2, 3, 4, 5)]
    s = sig(late, iters=0, generated=0, scored=0)
    assert st.time_fraction(0.25) == pytest.approx(0.45)
    tl = _timeline(st, s)
    assert tl.iters[0][1] == 0.0 and tl.iters[1][1] == pytest.approx(0.0)
    assert tl.first_started and tl.first_floor == 0.0      # no started-tail estimate: no floor
    tl = _timeline(st, dataclasses.replace(s, started_tail_tokens=3000.0))
    assert tl.first_floor == pytest.approx(st.costs.decode.step_s * 3000.0)


def test_tidal_does_not_release_instances_the_first_mini_batch_still_needs():
    """The CPU e2e shape at step start (costs as learned at one host core per device): mini-batch 0 is 64
    sequences, exactly the 4 instances' 16 slots each. Releasing one would leave a quarter of it waiting a wave for
    slots; priced without that wait, releasing one looks 0.2 s better, and on the host the first mini-batch then
    comes ~0.7 s later."""
    from scheduler.costs_cpu import cpu_e2e
    from scheduler.policy_tidal import decide
    cfg = build_config({"cluster": {"auto_scheduler": True},
                        "data": {"rollout_batch_size": 32},
                        "algorithm": {"group_size": 8, "n_minibatches": 4},
                        "rollout": {"max_running_requests": 16}}, [])
    params = PolicyParams.from_config(cfg)
    c = cpu_e2e()
    c = dataclasses.replace(c, decode=dataclasses.replace(c.decode, step_s=0.0125), kv_fixed_s=0.032,
                            lend_s=0.024, return_s=0.005, reshard=dataclasses.replace(c.reshard, fixed_s=0.047))
    # (lending off: this test is about releases)
    st = SchedState(dataclasses.replace(params, lend_actor=False), c, mean_response_tokens=17.0, prompt_tokens=9.0,
                    ready_curve=CURVE, rollout_time_factor=1.3, actor_time_factor=0.31)
    insts = [RolloutInstanceSignal(id=i, devices=(i,), groups_queued=4, groups_unfinished=8, running=64, total=64,
                                   tokens_generated=0, progress_tokens=0, token_rate=0.0, est_remaining_tokens=1075.0,
                                   est_tail_tokens=48.0) for i in (2, 3, 4, 5)]
    owners = (Owner.ACTOR,) * 2 + (Owner.ROLLOUT,) * 4 + (Owner.INFERENCE,) * 2
    s = Signals(0.0, 3, tuple(insts), InferenceSignal((6, 7), 0, 0, False),
                ActorSignal(0, 4, True, ActorLayout(1, 2, (0, 1)), 0.6), DeviceSignal(owners), 32, 0,
                rollout_tail_tokens=48.0)
    assert decide(st, s, 0.0) == []
    # once the first mini-batch is generated, the same move pays
    assert any(isinstance(a, ReleaseRollout) for a in decide(st, dataclasses.replace(s, groups_generated=8), 0.0))
