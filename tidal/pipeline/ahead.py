"""Groups of later RL steps generated ahead: the asynchronous run (`algorithm.max_staleness` k >= 1).

A synchronous step leaves rollout idle from its last group generated until the next step's weights arrive (the
actor's remaining iters, the sync). With k >= 1 the instances fill that time with later steps' groups::

    step s runs        its queue dealt first; then instances with room take groups of steps s+1 .. s+k (each
                       step's prompts drawn from the stream in step order, as its own step would draw them),
                       generated under the weights they hold (version s)
    results            of step s go to scoring; of a later step wait here (`AheadStep.generated`)
    step end, sync     engines take version s+1 with those requests in flight (`rollout.partial`: keep their KV
                       or recompute it); their later tokens record the new version
    step s+1 starts    its undealt groups form its queue, those in flight count as given to their instances, the
                       generated ones are scored first: inference holds version s+1, so the ratio's old policy is
                       the weights the step trains from, and the sampler's own log-probs carry the staleness (an
                       off-policy correction, `algorithm.rollout_is`, weighs it)

Invariant (staleness): a group of step t is dealt only while the engines hold version s >= t - k, and a version
only grows, so every token of a sample the actor trains at step t was sampled under a version >= t - k.

The driver owns this store (one writer); a lost instance's groups of later steps go back to their queues
(`lost`), a step abandoned on survivors forgets them all (`clear`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from tidal.engine.datasets import DataPosition
from tidal.engine.prompt_source import PromptLabel
from tidal.engine.records import RolloutGroup
from tidal.workers.rollout_instance import PromptGroup

#: a step's prompts from the stream at a position: (prompts with labels, the position after them)
Draw = Callable[[DataPosition], tuple[list[tuple[tuple[int, ...], PromptLabel]], DataPosition]]


@dataclass
class AheadStep:
    """One later step's work as far as it went before the step began."""

    step: int
    groups: dict[int, PromptGroup]
    queue: deque[PromptGroup]
    next_pos: DataPosition
    """The stream's position after this step's prompts (the next step draws from there)."""
    given: dict[int, int] = field(default_factory=dict)          # instance -> groups handed out, not returned
    generated: dict[int, RolloutGroup] = field(default_factory=dict)

    def dealt(self, instance: int, n: int) -> None:
        self.given[instance] = self.given.get(instance, 0) + n


def step_groups(step: int, prompts: list[tuple[tuple[int, ...], PromptLabel]]) -> list[PromptGroup]:
    """A step's prompt groups, ids 0.. in stream order."""
    return [PromptGroup(i, ids, label, step) for i, (ids, label) in enumerate(prompts)]


class Ahead:
    """The later steps' work of an asynchronous run (module doc)."""

    def __init__(self, max_staleness: int, last_step: int, draw: Draw):
        self.k, self.last_step, self._draw = max_staleness, last_step, draw
        self.steps: dict[int, AheadStep] = {}

    def dealable(self, step: int, engines_version: int, next_pos: DataPosition) -> Iterator[AheadStep]:
        """The later steps whose groups may be dealt now, in step order (each opened by drawing its prompts from
        where the step before it ended): up to `engines_version + k`, and none past the run's last step."""
        pos = next_pos
        for t in range(step + 1, min(engines_version + self.k, self.last_step) + 1):
            a = self.steps.get(t)
            if a is None:
                prompts, after = self._draw(pos)
                groups = step_groups(t, prompts)
                a = self.steps[t] = AheadStep(t, {g.group_id: g for g in groups}, deque(groups), after)
            pos = a.next_pos
            yield a

    def given_to(self, instance: int) -> int:
        """Groups of later steps handed to `instance` and not returned."""
        return sum(a.given.get(instance, 0) for a in self.steps.values())

    def arrived(self, instance: int, records: Iterable[RolloutGroup]) -> None:
        """Generated groups of later steps came back from `instance`."""
        for r in records:
            a = self.steps[r.step]
            assert r.group_id not in a.generated, f"group {r.group_id} of step {r.step} generated twice"
            a.generated[r.group_id] = r
            a.given[instance] = max(0, a.given.get(instance, 0) - 1)

    def pop(self, step: int) -> AheadStep | None:
        """Step `step` begins: its work so far, no longer ahead."""
        return self.steps.pop(step, None)

    def lost(self, instance: int, held: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
        """`instance` is gone: per later step, the groups nothing holds any more (not generated, not queued, not
        `held` by a survivor as (step, group id)) go back to the front of its queue, in id order. Returns them."""
        holding = set(held)
        out = {}
        for t, a in self.steps.items():
            a.given.pop(instance, None)
            queued = {g.group_id for g in a.queue}
            missing = sorted(set(a.groups) - set(a.generated) - queued - {gid for s, gid in holding if s == t})
            if missing:
                a.queue.extendleft(reversed([a.groups[gid] for gid in missing]))
                out[t] = missing
        return out

    def clear(self) -> None:
        """Every later step's work forgotten (the engines that held it were dropped)."""
        self.steps.clear()
