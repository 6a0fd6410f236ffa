"""A training run on device workers: one RL step streams prompt groups rollout -> inference -> actor.

- `run.py` (`TrainingRun`: inputs, workers, steps, checkpoints, MLflow and database records; `run_training`),
  `run_loop.py` (the one run loop `tidal train` and the `rl-training` flow both drive: each step's phases as pure
  decisions, recovery, resume), `inputs.py` (model, tokenizer, prompts and verifier from a config),
  `task_checkpoint.py` (`tidal warm-start`).
- `driver.py` (`Pipeline`: one step's event loop: feeds rollout and inference, starts actor iters), `cluster.py`
  (`Cluster`, `StepState`, `StepMeasurements`: calls in flight, the step's work and what it measured),
  `generations.py` (`Generations`: the policy version the engines run, kept copies, the weight sync),
  `control.py` (`ControlLoop`: the real run's observations around `scheduler.loop.Controller`; the step end),
  `actuator.py` (`RayActuator`: the scheduler's actions as worker calls and ledger transitions; the one owner of
  the placement, `placement.py`), `faults.py` (`Recovery`: a lost rollout or inference device's work redone on
  the survivors, the device FAILED), `survivors.py` (a loss beyond the step: the run goes on on its survivors).
- `checkpointing.py`, `recording.py`, `timeline.py`, `tracked_run.py`: checkpoints, events, device time lines;
  `run_metrics.py`: what a step logs besides its components' metrics (event counts and totals, the events
  table's columns, the devices per component over wall time). docs/middle.md draws how they fit.

May import: the core (`tidal.core`), `tidal.engine`, `tidal.workers` (never Ray itself), `scheduler`,
`tidal.tracking`, `db`.

Invariants: iter k trains on the sequences [k*S/n, (k+1)*S/n) of the step in group-id order, whatever the
placement, so a dynamic run updates exactly like a static one; a device changes owner only through the
`DeviceLedger` and a component changes devices only through the actuator; every scheduler action is one `action`
event with its outcome; a lost rollout or inference device is one `device_failed` event, and the step's groups
are still each generated and scored once, with the tokens and log-probs of a run without the loss.
"""
