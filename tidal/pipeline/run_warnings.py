"""Warnings a user needs about a run that is not learning: each kind once, with what it means and what to try.

    zero_advantage   a step in which every group's rewards were all equal: no policy gradient at all
    warm_start       the warm start ended at its iteration cap below `warm_start.stop_at_accuracy`
    flat_reward      the mean reward was the same at every step of a finished run

Pure: `RunWarnings` looks at the figures a run already has and returns the warnings that are new; the run
(`tidal.pipeline.run.TrainingRun`) hands them to its logger (the CLI and Prefect show it), the MLflow run
(a `warning.<kind>` tag) and the summary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunWarning:
    kind: str
    message: str


@dataclass
class RunWarnings:
    seen: set[str] = field(default_factory=set)

    def _new(self, kind: str, message: str) -> list[RunWarning]:
        if kind in self.seen:
            return []
        self.seen.add(kind)
        return [RunWarning(kind, message)]

    def after_warm_start(self, meta: dict[str, Any], stop_at: float | None) -> list[RunWarning]:
        """The warm start's own record (`prepare_weights`): did it reach the accuracy it was asked to stop at?"""
        acc = meta.get("heldout_accuracy")
        if stop_at is None or acc is None or acc >= stop_at:
            return []
        history = meta.get("history") or [{}]
        iters = history[-1].get("iter", meta.get("iters", "?"))
        return self._new("warm_start", f"the warm start ended after {iters} iters at held-out "
                                       f"accuracy {acc:.3f}, below warm_start.stop_at_accuracy={stop_at}: RL starts "
                                       "from a model that has not reached its plateau (raise warm_start.iters)")

    def after_step(self, step: int, metrics: Mapping[str, float]) -> list[RunWarning]:
        if metrics.get("grpo/zero_adv_group_frac", 0.0) < 1.0:
            return []
        return self._new("zero_advantage", f"step {step}: every group has zero advantage (its responses were all "
                                           "rewarded alike), so the step trained nothing; if this persists, check "
                                           "the verifier on a few responses, or raise rollout.temperature or "
                                           "algorithm.group_size")

    def at_finish(self, rewards: Sequence[float]) -> list[RunWarning]:
        if len(rewards) < 2 or max(rewards) != min(rewards):
            return []
        return self._new("flat_reward", f"the mean reward was {rewards[0]:.3f} at every one of {len(rewards)} "
                                        "steps: the run learned nothing measurable (see the zero-advantage "
                                        "warning, the verifier and the prompts)")
