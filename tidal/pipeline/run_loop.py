"""The loop of a training run, written once: which phases each RL step runs (pure decisions) and one driver over a
handful of verbs. `run_training` (`tidal train`, a sweep's real trials) drives it with direct calls on a
`TrainingRun`; the `rl-training` flow with its Prefect tasks, each step a subflow. For the same config both run
the same phases in the same order, because both run this code.

    run_loop(verbs, loop, first_step) -> the run's summary
      verbs.keep_host_copy()                   actor.redundancy: host: the state before the first step
      step = first_step                        0, or the step a resumed checkpoint names (`TrainingRun.next_step`)
      while step < loop.num_steps:
          plan = plan_step(loop, step)         pure: the step's phases, in order
          metrics = verbs.step(plan)           run_phases(plan, step verbs):
              run_step ──► sync_weights ──► evaluate ──► record ──► checkpoint | keep_host_copy
                                            (if due)              (due: every checkpoint_every steps and after the
                                                                   last; else with actor.redundancy: host the copy)
          on a RECOVERABLE failure: may_recover(loop, restarts)? step = verbs.recover(failure) (the step the state
              kept names; the steps since run again) : the failure ends the run
          verbs.report(step, metrics)          a progress line, the step's warnings
          step += 1
      summary = verbs.finish()
      verbs.close(status)                      always: FINISHED, else `closing_status` of what ended the run

Each phase needs the one before: evaluation measures the synced weights, the record holds the evaluation, and a
checkpoint is taken between steps, where a generation names the steps completed (the record counts the step).

Worked example, `num_steps=3, eval_every=2, checkpoint_every=0`, no host copy, from step 0::

    step 0: run_step sync_weights record
    step 1: run_step sync_weights evaluate record
    step 2: run_step sync_weights evaluate record checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

from tidal.core.config import TidalConfig
from tidal.pipeline.tracked_run import closed_with_status
from tidal.workers.errors import WorkerDied, WorkerTimeout

#: the failures `TrainingRun.recover` answers: a device lost beyond what a step absorbs, or a call hung past its limit
Recoverable = WorkerDied | WorkerTimeout
RECOVERABLE: tuple[type[WorkerDied], type[WorkerTimeout]] = (WorkerDied, WorkerTimeout)

SummaryT = TypeVar("SummaryT", covariant=True)


class Phase(StrEnum):
    """One phase of an RL step; its value names the `TrainingRun` verb that runs it (the flow's task is that name
    dashed, `record` being `record-step`)."""

    RUN_STEP = "run_step"              #: generate | score | train iters, streaming on the workers
    SYNC_WEIGHTS = "sync_weights"      #: the actor's weights to rollout and inference (the next policy version)
    EVALUATE = "evaluate"              #: held-out accuracy of the synced weights
    RECORD = "record"                  #: metrics and events to the sink, rows to the database; the step counts
    CHECKPOINT = "checkpoint"          #: a resumable checkpoint generation after the step
    HOST_COPY = "keep_host_copy"       #: actor.redundancy: host: the run's state into host memory


@dataclass(frozen=True)
class LoopSettings:
    """What the loop reads of a config (`from_config`); small and picklable, so a flow carries it."""

    num_steps: int          #: run.num_steps: steps are numbered 0 .. num_steps - 1
    eval_every: int         #: run.eval_every: evaluate after step s when (s + 1) % eval_every == 0, and after the last
    checkpoint_every: int   #: run.checkpoint_every: a checkpoint after step s when (s + 1) % it == 0; 0: the last only
    #: actor.redundancy == host: a host copy before the first step and after each step that takes no checkpoint
    host_copy: bool
    max_restarts: int       #: run.max_restarts: in-process recoveries before a RECOVERABLE failure ends the run

    @classmethod
    def from_config(cls, cfg: TidalConfig) -> LoopSettings:
        r = cfg.run
        return cls(r.num_steps, r.eval_every, r.checkpoint_every, cfg.actor.redundancy == "host", r.max_restarts)


@dataclass(frozen=True)
class StepPlan:
    """The phases RL step `step` runs, in order (`plan_step`)."""

    step: int
    phases: tuple[Phase, ...]

    @property
    def evaluates(self) -> bool:
        return Phase.EVALUATE in self.phases

    @property
    def checkpoints(self) -> bool:
        return Phase.CHECKPOINT in self.phases


def evaluation_due(loop: LoopSettings, step: int) -> bool:
    """Held-out evaluation after step `step`: every `eval_every` steps, and after the last."""
    return (step + 1) % loop.eval_every == 0 or step == loop.num_steps - 1


def checkpoint_due(loop: LoopSettings, step: int) -> bool:
    """A checkpoint after step `step`: every `checkpoint_every` steps (0: none on the way), and after the last."""
    return step == loop.num_steps - 1 or (loop.checkpoint_every > 0 and (step + 1) % loop.checkpoint_every == 0)


def plan_step(loop: LoopSettings, step: int) -> StepPlan:
    """The phases of step `step` (module doc). The host copy goes where no checkpoint is taken: a checkpoint is the
    newer state kept, and `TrainingRun.recover` takes the newest."""
    assert 0 <= step < loop.num_steps, (step, loop.num_steps)   # our invariant: the loop plans only its own steps
    phases = [Phase.RUN_STEP, Phase.SYNC_WEIGHTS]
    if evaluation_due(loop, step):
        phases.append(Phase.EVALUATE)
    phases.append(Phase.RECORD)
    if checkpoint_due(loop, step):
        phases.append(Phase.CHECKPOINT)
    elif loop.host_copy:
        phases.append(Phase.HOST_COPY)
    return StepPlan(step, tuple(phases))


def may_recover(loop: LoopSettings, restarts: int) -> bool:
    """Whether a RECOVERABLE failure is answered in process after `restarts` recoveries (else it ends the run)."""
    return restarts < loop.max_restarts


class StepVerbs(Protocol):
    """The phases of one step as calls (`run_phases` makes them in the plan's order)."""

    def run_step(self, step: int) -> object: ...

    def sync_weights(self) -> object: ...

    def evaluate(self) -> object: ...

    def record(self) -> dict[str, float]: ...

    def checkpoint(self) -> object: ...

    def keep_host_copy(self) -> object: ...


def run_phases(plan: StepPlan, verbs: StepVerbs) -> dict[str, float]:
    """Run the plan's phases in order; returns the step's metrics (what `record` wrote)."""
    metrics: dict[str, float] | None = None
    for phase in plan.phases:
        match phase:
            case Phase.RUN_STEP:
                verbs.run_step(plan.step)
            case Phase.SYNC_WEIGHTS:
                verbs.sync_weights()
            case Phase.EVALUATE:
                verbs.evaluate()
            case Phase.RECORD:
                metrics = verbs.record()
            case Phase.CHECKPOINT:
                verbs.checkpoint()
            case Phase.HOST_COPY:
                verbs.keep_host_copy()
    assert metrics is not None, plan   # our invariant: every plan records its step
    return metrics


class RunVerbs(Protocol[SummaryT]):
    """What `run_loop` asks of a run. `step` runs a plan's phases as one unit (`run_phases`; in the flow a subflow
    run), `recover` answers a RECOVERABLE failure and returns the step to run next, `report` follows each step,
    `close` ends the run with a status (FINISHED, FAILED, KILLED) whatever happened."""

    def keep_host_copy(self) -> object: ...

    def step(self, plan: StepPlan) -> dict[str, float]: ...

    def recover(self, failure: Recoverable) -> int: ...

    def report(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self) -> SummaryT: ...

    def close(self, status: str) -> None: ...


def run_loop(verbs: RunVerbs[SummaryT], loop: LoopSettings, first_step: int) -> SummaryT:
    """Steps `first_step` .. `loop.num_steps - 1` of an open run, then its summary; the run is closed in every case
    (module doc). A RECOVERABLE failure is answered `loop.max_restarts` times, the loop going on at the step
    `recover` returns; the next one, or any other error, ends the run."""
    with closed_with_status(verbs.close):
        if loop.host_copy:
            verbs.keep_host_copy()   # losing an actor device in the first step redoes only that step
        step, restarts = first_step, 0
        while step < loop.num_steps:
            try:
                metrics = verbs.step(plan_step(loop, step))
            except RECOVERABLE as failure:
                if not may_recover(loop, restarts):
                    raise
                restarts += 1
                step = verbs.recover(failure)
                continue
            verbs.report(step, metrics)
            step += 1
        return verbs.finish()
