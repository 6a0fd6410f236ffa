"""A rollout instance: pulls whole prompt groups from the step's shared queue, streams finished groups out.

Plain Python object, driven by whoever owns the engine (a device worker's loop, a test, a benchmark); no Ray.

    GroupQueue (one per RL step, shared by all instances; a lock, no static split)
        │ take() whole groups while the local backlog is under one decode width
        v
    RolloutInstance.pump():  refill -> engine.step() -> collect finished samples
        │ a group whose group_size samples are all done is emitted at once
        v
    emit(RolloutGroup)  (callback: an output queue, the driver's stream)

Every sample of a group is its own request, id `s{step}/g{group_id}/i{k}`, seeded with
`derive_seed(run_seed, step, group_id, k)`: its tokens do not depend on the instance that runs it, the
batch it shares, or migrations (see `tidal.engine.generation.engine`).

Migration moves whole groups (`migrate_groups`): the finished samples travel as results, the running ones as
engine states, two-phase (`tidal.engine.generation.migration`); the group is then completed and emitted by
the target, exactly once. `signals()` returns a typed snapshot for the scheduler.

Example::

    queue = GroupQueue([PromptGroup(0, (1, 4, 2)), PromptGroup(1, (1, 3, 3))])
    out = []
    inst = RolloutInstance("r0", engine, queue, out.append, SamplingParams(), group_size=4, run_seed=0, step=0)
    while not inst.done():
        inst.pump()
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from tidal.core.errors import TidalError
from tidal.engine.datasets import PromptLabel
from tidal.engine.generation.migration import migrate
from tidal.engine.generation.protocol import GenerationEngine, GenerationError
from tidal.engine.generation.requests import Request, RequestResult, SamplingParams, derive_seed


@dataclass(frozen=True)
class PromptGroup:
    """One prompt of an RL step; `group_size` samples are drawn from it."""

    group_id: int
    prompt_ids: tuple[int, ...]
    label: PromptLabel | None = None
    step: int | None = None
    """The RL step it belongs to; None: its instance's (`RolloutInstance.step`). An asynchronous run gives an
    instance groups of later steps too (generated under older weights)."""


@dataclass(frozen=True)
class RolloutGroup:
    """A finished GRPO group: `samples[k]` is sample k; `policy_version` is the oldest of its samples' (they differ
    where the weights were updated while the group was in flight: a partial rollout)."""

    step: int
    group_id: int
    prompt_ids: tuple[int, ...]
    samples: tuple[RequestResult, ...]
    policy_version: int
    label: PromptLabel | None = None

    @property
    def response_ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(s.token_ids for s in self.samples)


@dataclass(frozen=True)
class InstanceSignals:
    """What the scheduler sees of one instance (a snapshot; rates over the last `rate_window_s`)."""

    instance_id: str
    groups_in_progress: int
    """Groups pulled here and not emitted yet."""
    running_requests: int
    waiting_requests: int
    tokens_generated: int
    token_rate: float
    """Tokens/s over the recent window (0 until two samples exist)."""
    groups_emitted: int
    queue_remaining: int
    """Groups still in the shared queue (all instances see the same number)."""


class GroupQueue:
    """The step's work queue: whole groups, first come first served, safe across threads."""

    def __init__(self, groups: Iterable[PromptGroup]):
        self._groups = deque(groups)
        self._lock = threading.Lock()

    def take(self) -> PromptGroup | None:
        with self._lock:
            return self._groups.popleft() if self._groups else None

    def remaining(self) -> int:
        with self._lock:
            return len(self._groups)

    def extend(self, groups: Iterable[PromptGroup]) -> None:
        """More groups at the back (a driver handing work to this instance, or migrated-in groups)."""
        with self._lock:
            self._groups.extend(groups)

    def group_ids(self) -> list[int]:
        """Ids of the groups waiting here, front first."""
        with self._lock:
            return [g.group_id for g in self._groups]

    def groups(self) -> list[PromptGroup]:
        """The groups waiting here, front first."""
        with self._lock:
            return list(self._groups)

    def pop_back(self) -> PromptGroup:
        """The last group (migration takes not-started groups from the back)."""
        with self._lock:
            return self._groups.pop()


@dataclass
class _Group:
    group: PromptGroup
    results: dict[int, RequestResult] = field(default_factory=dict)


def request_id(step: int, group_id: int, k: int) -> str:
    return f"s{step}/g{group_id}/i{k}"


def _group_of(rid: str) -> tuple[tuple[int, int], int]:
    """((step, group id), sample index) of a request id."""
    s, g, k = rid.split("/")
    return (int(s[1:]), int(g[1:])), int(k[1:])


class RolloutInstance:
    def __init__(self, instance_id: str, engine: GenerationEngine, queue: GroupQueue,
                 emit: Callable[[RolloutGroup], None], params: SamplingParams, group_size: int, run_seed: int,
                 step: int, clock: Callable[[], float] = time.monotonic, rate_window_s: float = 5.0):
        if group_size < 1:
            raise TidalError("algorithm.group_size", group_size, "must be >= 1", "e.g. 8")
        self.instance_id, self.engine, self.queue, self.emit = instance_id, engine, queue, emit
        self.params, self.group_size, self.run_seed, self.step = params, group_size, run_seed, step
        self.clock, self.rate_window_s = clock, rate_window_s
        self._groups: dict[tuple[int, int], _Group] = {}   # by (step, group id)
        self._queue_empty = False
        self._emitted = 0
        self._tokens = 0
        self._rate_samples: deque[tuple[float, int]] = deque()

    # ---- driving -----------------------------------------------------------------------------------------
    def _backlog_target(self) -> int:
        return getattr(self.engine, "width", 1)

    def refill(self) -> int:
        """Pull whole groups while the local backlog is under one decode width; returns groups pulled."""
        pulled = 0
        while not self._queue_empty and self.engine.num_waiting() < self._backlog_target():
            group = self.queue.take()
            if group is None:
                self._queue_empty = True
                break
            step = self.step_of(group)
            self._groups[step, group.group_id] = _Group(group)
            for k in range(self.group_size):
                self.engine.add(Request(request_id(step, group.group_id, k), group.prompt_ids, self.params,
                                        derive_seed(self.run_seed, step, group.group_id, k)))
            pulled += 1
        return pulled

    def pump(self) -> int:
        """One iteration: refill, one engine step, emit finished groups. Returns tokens generated."""
        self.refill()
        before = getattr(self.engine, "tokens_generated", 0)
        finished = [ev.result for ev in self.engine.step() if ev.result is not None] if self.engine.has_work() else []
        for result in finished:
            self._collect(result)
        made = getattr(self.engine, "tokens_generated", 0) - before
        self._tokens += made
        now = self.clock()
        self._rate_samples.append((now, self._tokens))
        while len(self._rate_samples) > 2 and now - self._rate_samples[0][0] > self.rate_window_s:
            self._rate_samples.popleft()
        return made

    def step_of(self, group: PromptGroup) -> int:
        return self.step if group.step is None else group.step

    def _collect(self, result: RequestResult) -> None:
        key, k = _group_of(result.request_id)
        g = self._groups[key]
        assert k not in g.results, f"sample {result.request_id} finished twice"
        g.results[k] = result
        self._emit_if_complete(key)

    def done(self) -> bool:
        """True when the shared queue gave nothing more and every pulled group was emitted or moved away."""
        if not self._queue_empty and self.queue.remaining() == 0:
            self._queue_empty = True
        return self._queue_empty and not self._groups

    def signals(self) -> InstanceSignals:
        rate = 0.0
        if len(self._rate_samples) >= 2:
            (t0, n0), (t1, n1) = self._rate_samples[0], self._rate_samples[-1]
            rate = (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0
        return InstanceSignals(self.instance_id, len(self._groups), self.engine.num_running(),
                               self.engine.num_waiting(), self._tokens, rate, self._emitted, self.queue.remaining())

    def group_ids(self) -> list[int]:
        """Ids of the open groups of this instance's step."""
        return [gid for step, gid in self._groups if step == self.step]

    def group_keys(self) -> list[tuple[int, int]]:
        """(step, group id) of every open group, later steps' included."""
        return list(self._groups)

    def reopen(self) -> None:
        """New work arrived in the queue after it ran dry (the driver feeds it, or a migration)."""
        self._queue_empty = False

    def group_snapshot(self, gid: int) -> tuple[PromptGroup, dict[int, RequestResult]]:
        """(the group, its finished samples) of an open group of this instance's step, for moving it to another
        process."""
        g = self._groups[self.step, gid]
        return g.group, dict(g.results)

    def adopt_group(self, group: PromptGroup, results: dict[int, RequestResult]) -> None:
        """Take over an open group whose running samples were imported into this engine."""
        key = (self.step_of(group), group.group_id)
        if key in self._groups:
            raise GenerationError(f"adopt_group: group {group.group_id} is already open on {self.instance_id}")
        self._groups[key] = _Group(group, dict(results))
        self._emit_if_complete(key)  # every sample may have finished before the move

    def _emit_if_complete(self, key: tuple[int, int]) -> None:
        g = self._groups[key]
        if len(g.results) == self.group_size:
            del self._groups[key]
            samples = tuple(g.results[i] for i in range(self.group_size))
            self.emit(RolloutGroup(key[0], key[1], g.group.prompt_ids, samples,
                                   min(s.policy_version for s in samples), g.group.label))
            self._emitted += 1

    def drop_group(self, gid: int) -> None:
        """Forget an open group of this instance's step that moved to another instance (its requests were
        committed away)."""
        self._groups.pop((self.step, gid), None)


def migrate_groups(source: RolloutInstance, target: RolloutInstance, group_ids: Sequence[int] | None = None
                   ) -> list[int]:
    """Move whole groups (default: all of the source's) to another instance of the same step, two-phase.

    The engine part is `migrate` (all or nothing; on failure the source keeps everything and the error is
    raised); the bookkeeping (finished samples) moves only after the engine commit. Returns the moved ids."""
    if (source.step, source.group_size, source.run_seed) != (target.step, target.group_size, target.run_seed):
        raise GenerationError("migrate_groups: instances serve different steps/group sizes/seeds "
                              f"({source.step, source.group_size, source.run_seed} vs "
                              f"{target.step, target.group_size, target.run_seed})")
    gids = list(source.group_ids() if group_ids is None else group_ids)
    unknown = [g for g in gids if (source.step, g) not in source._groups]
    if unknown:
        raise GenerationError(f"migrate_groups: groups {unknown} are not in progress on {source.instance_id} "
                              f"(in progress: {source.group_ids()[:8]})")
    wanted = {(source.step, g) for g in gids}
    ids = [rid for rid in source.engine.request_ids() if _group_of(rid)[0] in wanted]
    migrate(source.engine, target.engine, ids)
    for key in wanted:
        target._groups[key] = source._groups.pop(key)
    # a group whose samples had all finished but one can now complete on the target only: nothing to do here
    return gids
