"""A rollout or inference device lost in the middle of a step costs its work, not the run.

Detection (the driver's loop, every pass): a worker whose process is gone (`WorkerDied`: its pid left /proc, or
Ray's actor-death error on a call) or a rollout/inference call with no result after `cluster.failure_timeout_s`
(`overdue`: the worker is killed, so no late result of it arrives). Either becomes a `DeviceFailure`: the device
goes to FAILED in the ledger with the reason, and one `device_failed` event records it (role, reason, calls lost,
the groups redone, `seconds` from detection to the work handed over, `bytes` of work handed over: the pickled
groups, as Ray carries them). When the last redone group is back (generated, or scored) one `device_recovered` event
records the recovery: `seconds` from the failure, the groups and the `tokens` redone (response tokens generated, or
scored, again); the failed device's lane of the timeline shows that span (`Timeline.recovery`). The policies see
the failure in the ledger (`DeviceSignal`) and in the components' device lists, which no longer hold it.

Recovery (`Recovery.recover`), what the step still owes and who redoes it::

    rollout device lost                                 inference device lost
    ───────────────────                                 ─────────────────────
    its calls forgotten (a late result is dropped)      its calls forgotten; the groups they carried go
    survivors' slices drained, then each says which     back to the scoring queue (`to_score`), scored
      groups it holds (`roles_rollout.rollout_holding`)         again on a survivor
    lost = not generated, not in the shared queue,
      not held by a survivor: back to the front of
      the shared queue, regenerated from their prompts

Nothing is lost or duplicated: a group counts as generated only when its record reaches the driver, and a lost
device's late results are never read. Nothing changes either: every sample draws from its own generator seeded by
(run seed, step, group id, sample index), and a group is scored on its own, so a regenerated group has the same
tokens and log-probs, and the run the same parameters, bit for bit, as a run without the fault.

Not recovered here (the step raises `WorkerDied`): the actor's devices, lent and shared devices, the last device of
a component, and a loss outside a step's streaming loop (the weight sync, a checkpoint); `run_training` then carries
on with the surviving workers from the newest state kept (`TrainingRun.recover`, `tidal.pipeline.survivors`,
`run.max_restarts`).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tidal.core.devices import DeviceFailure, DeviceLedger, Owner
from tidal.pipeline.actuator import RayActuator
from tidal.pipeline.ahead import Ahead
from tidal.pipeline.cluster import CallKind, Cluster, Flight, StepState
from tidal.workers.errors import WorkerDied

log = logging.getLogger("tidal.pipeline")


def lost_groups(num_groups: int, generated: Iterable[int], queued: Iterable[int], held: Iterable[int]) -> list[int]:
    """The step's group ids nothing holds any more: not generated, not in the shared queue, not held by a
    surviving instance. Ascending (the actor trains on prefixes of group ids).

    >>> lost_groups(6, generated=[0, 1], queued=[5], held=[2, 4])
    [3]
    """
    return sorted(set(range(num_groups)) - set(generated) - set(queued) - set(held))


def overdue(c: Cluster, now: float, timeout_s: float) -> tuple[int, float] | None:
    """A rollout or inference call in flight for more than `timeout_s`: (its device, seconds), the oldest."""
    late = [(now - f.t0, f.device) for f in c.inflight.values()
            if f.kind in (CallKind.ROLLOUT, CallKind.INFERENCE) and now - f.t0 > timeout_s]
    if not late:
        return None
    secs, device = max(late)
    return device, secs


def payload_bytes(groups: Iterable[Any]) -> int:
    """Bytes of `groups` as Ray carries them to a survivor (pickled)."""
    return len(pickle.dumps(list(groups), protocol=pickle.HIGHEST_PROTOCOL))


@dataclass
class Redo:
    """Work of a lost device still being redone: group ids not back yet, and what came back so far."""

    device: int
    role: str
    step: int
    failed_at: float
    waiting: set[int]
    groups: int
    tokens: int = 0


class Recovery:
    """Takes a lost rollout or inference device out of the step and hands its work to the survivors; says when
    the work is done again (`generated`, `scored`: the driver hands it what comes back)."""

    def __init__(self, c: Cluster, ledger: DeviceLedger, handle: Callable[[Flight, Any], None],
                 actuator: RayActuator, ahead: Ahead | None = None):
        self.c, self.ledger, self.handle, self.actuator = c, ledger, handle, actuator
        self.ahead = ahead   # an asynchronous run's later steps, whose groups a lost instance held too
        self.redoing: list[Redo] = []   # recoveries whose redone groups are not all back

    def recoverable(self, device: int) -> bool:
        """A rollout or inference device of its own (not the actor's, not lent, not shared), with a survivor of
        its component to take its work."""
        p, owner = self.actuator.placement, self.ledger.owner(device)
        if device in p.lent or device in p.actor.devices or device in p.inference_lent:
            return False
        if owner is Owner.ROLLOUT and device in p.rollout:
            return len(p.rollout) > 1
        if owner is Owner.INFERENCE and device in p.inference:
            return len(p.inference) > 1
        return False

    def recover(self, died: WorkerDied, st: StepState, overdue_s: float | None = None) -> DeviceFailure:
        """Device `died.device_id` is dead (or declared so): FAILED in the ledger, its work redone elsewhere.
        Raises `died` itself when the device is not `recoverable`."""
        c, d = self.c, died.device_id
        if not self.recoverable(d):
            raise died
        t0 = c.clock()
        failure = self.ledger.fail(d, died.reason)
        c.group.retire(d)
        lost_calls = [c.inflight.pop(ref) for ref, f in list(c.inflight.items()) if f.device == d]
        rollout = failure.role is Owner.ROLLOUT
        detail = self._rollout_lost(d, st) if rollout else self._inference_lost(d, st, lost_calls)
        seconds = c.clock() - t0
        redone, sent = next(iter(detail.values())), detail.pop("bytes")
        c.record("device_failed", step=st.step, device=d, role=failure.role.value, reason=failure.reason,
                 calls_lost=len(lost_calls), overdue_s=overdue_s, seconds=seconds, groups=len(redone), bytes=sent,
                 **detail)
        log.warning("device %d (%s) failed: %s; %s redone on %s in %.2fs", d, failure.role.value, failure.reason,
                    detail, self.actuator.placement.rollout if rollout else self.actuator.placement.inference, seconds)
        self.redoing.append(Redo(d, failure.role.value, st.step, failure.time, set(redone), len(redone)))
        self._close(st.step)
        return failure

    def generated(self, records: Iterable[Any], step: int) -> None:
        """Generated groups reached the driver: those a lost rollout device's recovery waits for count."""
        self._arrived("rollout", records, step, lambda g: sum(len(r) for r in g.response_ids))

    def scored(self, scored: Iterable[Any], step: int) -> None:
        """Scored groups reached the driver: those a lost inference device's recovery waits for count."""
        self._arrived("inference", scored, step, lambda g: sum(len(r) for r in g.response_ids))

    def _arrived(self, role: str, groups: Iterable[Any], step: int, tokens: Callable[[Any], int]) -> None:
        if not self.redoing:
            return
        for g in groups:
            for r in self.redoing:
                if r.role == role and g.group_id in r.waiting:
                    r.waiting.discard(g.group_id)
                    r.tokens += tokens(g)
        self._close(step)

    def _close(self, step: int) -> None:
        """Every recovery whose redone groups are all back: a `device_recovered` event, a span on the device's
        lane (failure -> work done again)."""
        c, now = self.c, self.c.clock()
        for r in [r for r in self.redoing if not r.waiting]:
            self.redoing.remove(r)
            seconds = now - r.failed_at
            c.timeline.add_recovery(r.device, f"recovery {seconds:.2f}s", r.failed_at, now)
            c.record("device_recovered", step=step, device=r.device, role=r.role, seconds=seconds, groups=r.groups,
                     tokens=r.tokens, failed_step=r.step, reason=f"its {r.groups} groups done again on the survivors")

    def _rollout_lost(self, d: int, st: StepState) -> dict[str, Any]:
        c = self.c
        self.actuator.lose(d)
        for per_instance in (st.given, st.reports, st.waiting_since, st.last_result):
            per_instance.pop(d, None)
        survivors = list(self.actuator.placement.rollout)
        c.drain(self.handle, set(survivors))   # their slices end; what they finished reaches the driver first
        held = [key for keys in c.group.gather(c.endpoints.rollout.holding(survivors)) for key in keys]
        lost = lost_groups(st.num_groups, st.gen_time, (g.group_id for g in st.queue),
                           (gid for s, gid in held if s == st.step))
        later = self.ahead.lost(d, held) if self.ahead is not None else {}   # back to their steps' queues
        # back to the front of the shared queue, which stays in group-id order
        st.queue.extend(st.groups[i] for i in lost)
        ordered = sorted(st.queue, key=lambda g: g.group_id)
        st.queue.clear()
        st.queue.extend(ordered)
        detail: dict[str, Any] = {"groups_regenerated": lost, "bytes": payload_bytes(st.groups[i] for i in lost)}
        if later:
            detail["later_groups_regenerated"] = {str(t): gids for t, gids in later.items()}
        return detail

    def _inference_lost(self, d: int, st: StepState, lost_calls: list[Flight]) -> dict[str, Any]:
        self.actuator.lose(d)
        again = [g for f in lost_calls if f.kind is CallKind.INFERENCE for g in f.payload]
        st.scoring -= len(again)
        st.to_score.extend(again)
        return {"groups_rescored": sorted(g.group_id for g in again), "bytes": payload_bytes(again)}
