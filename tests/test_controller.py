"""The controller (`scheduler.loop`) and `reconcile` against a fake actuator, and the same decisions from the
simulator's and the real run's sides of it for the same observations."""

from dataclasses import dataclass, field
from typing import Any

import pytest

from scheduler import catalog
from scheduler.actions import LendToRollout, MigrateRequests, ReleaseInference, Wait, describe
from scheduler.estimate import LengthModel
from scheduler.loop import Consultation, Controller, decision_event
from scheduler.policies import get_policy
from scheduler.reconcile import MAX_FAILURES_PER_STEP, apply_action, reconcile
from scheduler.signals import Signals
from scheduler.simulator import _Sim
from scheduler.workload import SimSpec
from tidal.core.config import load_config
from tidal.core.devices import DeviceLedger
from tidal.engine.layout import Layout
from tidal.pipeline.actuator import RayActuator
from tidal.pipeline.cluster import Cluster
from tidal.pipeline.control import ControlLoop
from tidal.pipeline.placement import Homes
from tidal.pipeline.timeline import Timeline


@dataclass
class FakeActuator:
    """Applies nothing: notes each call; `refuse` names the methods that raise (a worker's refusal)."""

    refuse: set[str] = field(default_factory=set)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def _apply(self, name: str, a: Any) -> dict[str, Any]:
        self.calls.append((name, a))
        if name in self.refuse:
            raise RuntimeError(f"{name} refused")
        return {"applied": name}

    def wait(self, a: Wait) -> None:
        self.calls.append(("wait", a))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda a: self._apply(name, a)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _migrate(n: int = 1) -> MigrateRequests:
    return MigrateRequests(src=1, dst=2, count=n, reason="test")


def test_reconcile_applies_each_action_through_its_method_in_order():
    act = FakeActuator()
    lend = LendToRollout(devices=(0,), instance_ids=(0,), reason="test")
    outcomes, held = reconcile([_migrate(), lend], act, Clock(), contain=False)
    assert [name for name, _ in act.calls] == ["migrate_requests", "lend_to_rollout"]
    assert [o.detail for o in outcomes] == [{"applied": "migrate_requests"}, {"applied": "lend_to_rollout"}]
    assert all(o.ok for o in outcomes) and not held


def test_reconcile_contains_a_failed_action_and_goes_on():
    act = FakeActuator(refuse={"migrate_requests"})
    release = ReleaseInference(devices=(5,), reason="test")
    outcomes, held = reconcile([_migrate(), release, Wait(reason="hold")], act, Clock(), contain=True)
    assert [o.ok for o in outcomes] == [False, True]   # the Wait is no outcome: it holds
    assert outcomes[0].error == "RuntimeError: migrate_requests refused"
    assert held and [n for n, _ in act.calls] == ["migrate_requests", "release_inference", "wait"]
    with pytest.raises(RuntimeError, match="refused"):
        reconcile([_migrate()], act, Clock(), contain=False)


def test_apply_action_refuses_an_action_without_a_method():
    @dataclass(frozen=True)
    class Unknown:
        reason: str = ""

    with pytest.raises(TypeError, match="no actuator method for Unknown"):
        apply_action(Unknown(), FakeActuator())   # type: ignore[arg-type]


def _signals(step: int = 0, now: float = 0.0) -> Signals:
    """Real signals of a small simulated step, at its start."""
    sim = _Sim(SimSpec.from_config(load_config("experiments/addition_dynamic.yaml")), "tidal", 0, False)
    sim._reset_step(step)
    sim.now = now
    return sim.signals("boundary")


def _controller(policy: Any, events: list[tuple[str, dict[str, Any]]], **kw: Any) -> Controller:
    sim = _Sim(SimSpec.from_config(load_config("experiments/addition_dynamic.yaml")), "tidal", 0, False)
    return Controller(policy, sim.controller.state, lambda kind, **f: events.append((kind, f)), contain=True,
                      lengths=LengthModel.prior(64), **kw)


def test_the_breaker_opens_after_repeated_failures_and_the_step_goes_on():
    events: list[tuple[str, dict[str, Any]]] = []
    asked = []

    def policy(state, sig, now):
        asked.append(now)
        return [_migrate()]

    ctl = _controller(policy, events)
    act, clock, sig = FakeActuator(refuse={"migrate_requests"}), Clock(), _signals()
    for k in range(MAX_FAILURES_PER_STEP + 3):
        clock.now = float(k)
        out = ctl.consult("boundary", 0, lambda: sig, act, clock)
        assert not out.held
    assert len(asked) == MAX_FAILURES_PER_STEP   # not consulted once open
    kinds = [k for k, _ in events]
    assert kinds.count("decision") == kinds.count("action") == MAX_FAILURES_PER_STEP
    assert kinds.count("scheduler_paused") == 1 and all(not f["ok"] for k, f in events if k == "action")
    assert ctl.consult("boundary", 1, lambda: sig, act, clock).actions   # a new step: asked again


def test_the_throttle_skips_the_same_boundary_within_its_interval():
    events: list[tuple[str, dict[str, Any]]] = []
    held = [Wait(reason="hold")]
    ctl = _controller(lambda s, sig, now: held, events, min_interval_s=0.2)
    act, clock, sig = FakeActuator(), Clock(), _signals()
    first = ctl.consult("boundary", 0, lambda: sig, act, clock, throttle_key=(0, False))
    clock.now = 0.1
    again = ctl.consult("boundary", 0, lambda: sig, act, clock, throttle_key=(0, False))
    other = ctl.consult("boundary", 0, lambda: sig, act, clock, throttle_key=(0, True))
    clock.now = 0.35
    later = ctl.consult("boundary", 0, lambda: sig, act, clock, throttle_key=(0, True))
    assert first.held and not first.skipped
    assert again.skipped and again.held          # the last answer's hold stands
    assert not other.skipped and not later.skipped
    assert [n for n, _ in act.calls] == ["wait"] * 3


class RecordingActuator(FakeActuator):
    """The real run's actuator stand-in for a replay: accepts every action."""


def _real_control_loop(cfg: Any, policy: Any, state: Any) -> ControlLoop:
    """The real run's control loop, built as the driver builds it, on a cluster without workers."""
    ledger = DeviceLedger(range(cfg.placement.num_devices), clock=lambda: 0.0)
    cluster = Cluster(None, ledger, Timeline(), lambda: 0.0)   # type: ignore[arg-type]
    p, tp = cfg.placement, cfg.actor.tensor_parallel_size
    actuator = RayActuator(cluster, lambda devices: None, lambda d: {},
                           Homes(Layout(tp, len(p.actor) // tp, p.actor), p.rollout, p.inference), lambda loads: [])
    return ControlLoop(cfg, policy, state, cluster, ledger, actuator)


def test_the_simulator_and_the_real_run_decide_alike_for_the_same_observations():
    """Every consultation of a simulated step (its signals and trigger) replayed through the real run's control
    loop: the same actions and the same decision events, in the same order."""
    cfg = load_config("experiments/addition_dynamic.yaml")
    sim = _Sim(catalog.spec("longtail", "7b", 8), "tidal", 0, True)
    sim.controller.trace = []
    sim.run_step(0)
    trace: list[Consultation] = sim.controller.trace
    decided = [c for c in trace if c.actions]
    assert len(decided) >= 3 and any(not isinstance(a, Wait) for c in decided for a in c.actions), \
        "the simulated step moves devices"
    real = _real_control_loop(cfg, get_policy("tidal"), sim.controller.state)
    act = RecordingActuator()
    for c in trace:
        sig = c.signals
        assert sig is not None
        out = real.controller.consult(c.trigger, c.step, lambda s=sig: s, act, lambda t=sig.time: t)
        assert describe(list(out.actions)) == describe(list(c.actions))
    real_events = [{k: v for k, v in e.items() if k not in ("time", "decide_s")}
                   for e in real.c.events if e["kind"] == "decision"]
    sim_events = [{"kind": "decision", **{k: v for k, v in decision_event(c.signals, c.trigger, c.actions, 0.0).items()
                                          if k != "decide_s"}} for c in decided if c.signals is not None]
    assert real_events == sim_events
    # the simulator's own event list holds the same decided actions, line for line
    sim_lines = [e.detail for e in sim.events if e.kind == "action"]
    assert sim_lines == [line for c in decided for line in describe(list(c.actions))]

