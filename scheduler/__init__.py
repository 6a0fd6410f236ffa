"""The scheduler: pure decisions over typed records, and the simulator that exercises them at any scale.

One decision, the same in a real run and in the simulator:

    signals  = observe(...)                     observe.py: the one producer of `Signals` (signals.py)
    actions  = policy(state, signals, now)      policies.py -> policy_rlinf.py | policy_tidal.py | static
    outcomes = reconcile(actions, actuator)     reconcile.py: each `Action` (actions.py) through an `Actuator`

- `state.py` (`SchedState`: the policy's parameters, the cost model and what was learned), `costs.py` (the
  cost model and its online fits), `estimate.py` (response-length model), `learning.py` (what a finished step
  teaches the next), `rollout_model.py` (continuous batching in closed form), `workload.py` (`SimSpec`),
  `simulator.py` (discrete-event simulation; its `_Sim` is an `Actuator`), `sim_cli.py` (`tidal simulate`).

May import: the core (`tidal.core`: errors, devices, config, placement), numpy. Never the engine, the workers, the
pipeline or Ray (`tests/test_boundaries.py`): the real cluster's actuator is
`tidal.pipeline.actuator.RayActuator`.

Invariants: policies are pure functions of (state, signals, now); an action is complete (devices, instance ids,
layouts, counts), so applying it needs no further decision; every device changes owner through a
`DeviceLedger` (FREE -> role -> MOVING -> FREE), so a double-booked device fails in both worlds alike; the
simulator is deterministic for a (spec, policy, seed).
"""
