"""Repository functions: small verbs that take the caller's session.

Each function checks its inputs (`db.checks`, errors name the field, the value and the fix), adds
rows and flushes, so ids are assigned and constraint errors surface at the call, but never commits:
the caller owns the transaction (`session_scope`), and may group several records into one.

    with session_scope(engine) as s:
        run = add_run(s, name="gsm8k-grpo", config=public_dump(cfg), output_dir="runs/7")
    with session_scope(engine) as s:
        add_step(s, run.id, step=0, step_seconds=4.2, phase_seconds={"generate": 2.5, "train": 1.7}, reward=0.31)
        record_transitions(s, run.id, ledger.history)     # tidal.core.devices.Transition rows, as they are
    with session_scope(engine) as s:
        finish_run(s, run.id, status="finished")
        steps = list_steps(s, run.id)

Reads return ORM objects (`db.models`); with `session_scope` they stay readable after it closes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.checks import (
    InvalidRecord,
    check_bool,
    check_devices,
    check_float,
    check_int,
    check_json_object,
    check_nonneg_int,
    check_one_of,
    check_phase_seconds,
    check_str,
)
from db.models import (
    FAULT_KINDS,
    MIGRATION_MODES,
    OWNERS,
    RUN_STATUSES,
    SCHEDULER_KINDS,
    DeviceTransition,
    FaultEvent,
    MigrationEvent,
    ReshardEvent,
    Run,
    SchedulerEvent,
    Step,
)
from tidal.core.devices import Owner, Transition

FINAL_STATUSES = tuple(s for s in RUN_STATUSES if s not in ("running", "lost"))   # what a driver ends a run as
#: an MLflow run's final status -> the row's: the driver ends both with one word (`RunTracking.close`). KILLED is
#: `aborted`: stopped from outside (Ctrl-C, SIGTERM, a Prefect cancel), not failed by its own code. A `lost` row's
#: MLflow run ends KILLED too (`MlflowSink.end_lost_run`), but nothing ends a run `lost` through this map.
STATUS_OF_MLFLOW = {"FINISHED": "finished", "FAILED": "failed", "KILLED": "aborted"}
assert set(STATUS_OF_MLFLOW.values()) == set(FINAL_STATUSES)   # our invariant: every final status has one word


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _aware(field: str, value: object) -> dt.datetime:
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        raise InvalidRecord(field, value, "must be a timezone-aware datetime", "pass datetime.now(datetime.UTC)")
    return value


def _ident(field: str, value: object) -> str:
    """Request, group and instance ids: a non-empty string, or a non-negative int (stored as its string)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(check_nonneg_int(field, value))
    return check_str(field, value, max_len=64)  # type: ignore[return-value]


def get_run(session: Session, run_id: int) -> Run:
    """The run with id `run_id`; an `InvalidRecord` naming the id if there is none."""
    check_int("run_id", run_id, minimum=1)
    run = session.get(Run, run_id)
    if run is None:
        raise InvalidRecord("run_id", run_id, "names no run in this database", "call add_run first and use its id")
    return run


# --- runs -----------------------------------------------------------------------------------------------------


def add_run(session: Session, *, name: str, config: Mapping[str, Any], output_dir: str | None = None,
            mlflow_run_id: str | None = None, prefect_flow_run_id: str | None = None,
            started_at: dt.datetime | None = None) -> Run:
    """Start a run (status "running"). `config` is the resolved config as a JSON object; `prefect_flow_run_id`:
    the flow run that drives it, if a flow does."""
    run = Run(name=check_str("run.name", name, max_len=200), config=check_json_object("run.config", config),
              status="running", started_at=_now() if started_at is None else _aware("run.started_at", started_at),
              mlflow_run_id=check_str("run.mlflow_run_id", mlflow_run_id, max_len=64, optional=True),
              prefect_flow_run_id=check_str("run.prefect_flow_run_id", prefect_flow_run_id, max_len=64,
                                            optional=True),
              output_dir=check_str("run.output_dir", output_dir, optional=True))
    session.add(run)
    session.flush()
    return run


def attach_mlflow_run(session: Session, run_id: int, mlflow_run_id: str) -> Run:
    """Record the MLflow run id once MLflow has made it (usually just after `add_run`)."""
    run = get_run(session, run_id)
    run.mlflow_run_id = check_str("run.mlflow_run_id", mlflow_run_id, max_len=64)
    session.flush()
    return run


def status_of_mlflow(status: str) -> str:
    """The row's status for an MLflow run that ended `status` (FINISHED, FAILED, KILLED: `STATUS_OF_MLFLOW`)."""
    if status not in STATUS_OF_MLFLOW:
        raise InvalidRecord("run.status", status, f"is not an MLflow run's final status {tuple(STATUS_OF_MLFLOW)}",
                            "end the run FINISHED, FAILED or KILLED")
    return STATUS_OF_MLFLOW[status]


def finish_run(session: Session, run_id: int, *, status: str = "finished", ended_at: dt.datetime | None = None) -> Run:
    """End a running run as finished, failed or aborted; a run ends once."""
    run = get_run(session, run_id)
    status = check_one_of("run.status", status, FINAL_STATUSES)
    if run.status not in ("running", "lost"):   # a lost run's driver may still come back and end it
        raise InvalidRecord("run.status", status, f"run {run_id} already ended as {run.status!r}",
                            "finish a run once; start a new run to record another attempt")
    run.status = status
    run.ended_at = _now() if ended_at is None else _aware("run.ended_at", ended_at)
    session.flush()
    return run


def heartbeat(session: Session, run_id: int, *, at: dt.datetime | None = None) -> None:
    """The driver of run `run_id` is alive now (or at `at`)."""
    get_run(session, run_id).heartbeat_at = _now() if at is None else _aware("run.heartbeat_at", at)
    session.flush()


def mark_lost(session: Session, *, stale_after_s: float, now: dt.datetime | None = None) -> list[Run]:
    """Mark `lost` every running run whose driver has not said it is alive for `stale_after_s` (its last
    heartbeat, else its start); returns them. Their ended_at is the last sign of life."""
    now = _now() if now is None else _aware("now", now)
    cutoff = now - dt.timedelta(seconds=stale_after_s)
    lost = []
    for run in session.scalars(select(Run).where(Run.status == "running")):
        seen = run.heartbeat_at or run.started_at
        if seen < cutoff:
            run.status, run.ended_at = "lost", seen
            lost.append(run)
    session.flush()
    return lost


def list_runs(session: Session, *, status: str | None = None, prefect_flow_run_id: str | None = None) -> list[Run]:
    """All runs, oldest first; optionally only those of one status, or the one a Prefect flow run drove."""
    query = select(Run).order_by(Run.id)
    if status is not None:
        query = query.where(Run.status == check_one_of("status", status, RUN_STATUSES))
    if prefect_flow_run_id is not None:
        flow_run_id = check_str("prefect_flow_run_id", prefect_flow_run_id, max_len=64)
        query = query.where(Run.prefect_flow_run_id == flow_run_id)
    return list(session.scalars(query))


# --- steps ----------------------------------------------------------------------------------------------------


def add_step(session: Session, run_id: int, *, step: int, step_seconds: float, phase_seconds: Mapping[str, float],
             reward: float | None = None, eval_accuracy: float | None = None,
             device_idle_fraction: float | None = None) -> Step:
    """Record one step of a run (once). `phase_seconds` maps a phase name to its seconds in this step."""
    get_run(session, run_id)
    step = check_nonneg_int("step.step", step)
    if session.get(Step, (run_id, step)) is not None:
        raise InvalidRecord("step.step", step, f"step {step} of run {run_id} is already recorded",
                            "record each step once")
    row = Step(run_id=run_id, step=step,
               step_seconds=check_float("step.step_seconds", step_seconds, minimum=0.0),
               phase_seconds=check_phase_seconds("step.phase_seconds", phase_seconds),
               reward=check_float("step.reward", reward, optional=True),
               eval_accuracy=check_float("step.eval_accuracy", eval_accuracy, minimum=0.0, maximum=1.0, optional=True),
               device_idle_fraction=check_float("step.device_idle_fraction", device_idle_fraction,
                                                minimum=0.0, maximum=1.0, optional=True))
    session.add(row)
    session.flush()
    return row


def list_steps(session: Session, run_id: int) -> list[Step]:
    return list(session.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.step)))


def forget_steps_from(session: Session, run_id: int, step: int) -> int:
    """Delete the rows of steps >= `step` (a run restarted from a checkpoint of that step runs them again);
    returns how many. Events of those steps stay: they happened."""
    get_run(session, run_id)
    rows = list(session.scalars(select(Step).where(Step.run_id == run_id,
                                                   Step.step >= check_nonneg_int("step.step", step))))
    for row in rows:
        session.delete(row)
    session.flush()
    return len(rows)


# --- device ownership -----------------------------------------------------------------------------------------


def record_transition(session: Session, run_id: int, *, device_id: int, from_owner: Owner | str,
                      to_owner: Owner | str, reason: str, time: float) -> DeviceTransition:
    """Record one ownership move. Owners are `tidal.core.devices.Owner` members or their strings."""
    get_run(session, run_id)
    row = DeviceTransition(run_id=run_id, device_id=check_nonneg_int("transition.device_id", device_id),
                           from_owner=check_one_of("transition.from_owner", from_owner, OWNERS),
                           to_owner=check_one_of("transition.to_owner", to_owner, OWNERS),
                           reason=check_str("transition.reason", reason), time=check_float("transition.time", time))
    session.add(row)
    session.flush()
    return row


def record_transitions(session: Session, run_id: int, transitions: Iterable[Transition]) -> list[DeviceTransition]:
    """Record `tidal.core.devices.Transition` values (e.g. a ledger's new history rows) in order."""
    return [record_transition(session, run_id, device_id=t.device, from_owner=t.src, to_owner=t.dst,
                              reason=t.reason, time=t.time) for t in transitions]


def list_transitions(session: Session, run_id: int, *, device_id: int | None = None) -> list[DeviceTransition]:
    """Ownership history of a run (or of one of its devices), in the order it was recorded."""
    query = select(DeviceTransition).where(DeviceTransition.run_id == run_id)
    if device_id is not None:
        query = query.where(DeviceTransition.device_id == device_id)
    return list(session.scalars(query.order_by(DeviceTransition.id)))


# --- events ---------------------------------------------------------------------------------------------------


def record_reshard(session: Session, run_id: int, *, step: int, iter: int, from_layout: Mapping[str, Any] | Any,
                   to_layout: Mapping[str, Any] | Any, devices: Sequence[int], bytes_moved: int, seconds: float,
                   ok: bool, reason: str) -> ReshardEvent:
    """Record an actor reshard; `ok` False means it rolled back to `from_layout` (`reason` says why).

    Layouts are JSON objects or dataclass instances (converted with `dataclasses.asdict`).
    """
    get_run(session, run_id)
    row = ReshardEvent(run_id=run_id, step=check_nonneg_int("reshard.step", step),
                       iter=check_nonneg_int("reshard.iter", iter),
                       from_layout=check_json_object("reshard.from_layout", from_layout),
                       to_layout=check_json_object("reshard.to_layout", to_layout),
                       devices=check_devices("reshard.devices", devices),
                       bytes_moved=check_nonneg_int("reshard.bytes_moved", bytes_moved),
                       seconds=check_float("reshard.seconds", seconds, minimum=0.0),
                       ok=check_bool("reshard.ok", ok), reason=check_str("reshard.reason", reason))
    session.add(row)
    session.flush()
    return row


def record_migration(session: Session, run_id: int, *, step: int, request_id: str | int, group_id: str | int,
                     source_instance: str | int, target_instance: str | int, mode: str, tokens: int, bytes: int,
                     seconds: float, ok: bool, reason: str) -> MigrationEvent:
    """Record a request moved between rollout instances: `mode` "kv" (cache moved) or "reprefill"."""
    get_run(session, run_id)
    source = _ident("migration.source_instance", source_instance)
    target = _ident("migration.target_instance", target_instance)
    if source == target:
        raise InvalidRecord("migration.target_instance", target_instance, "is the source instance",
                            "a migration moves a request to a different instance")
    row = MigrationEvent(run_id=run_id, step=check_nonneg_int("migration.step", step),
                         request_id=_ident("migration.request_id", request_id),
                         group_id=_ident("migration.group_id", group_id),
                         source_instance=source, target_instance=target,
                         mode=check_one_of("migration.mode", mode, MIGRATION_MODES),
                         tokens=check_nonneg_int("migration.tokens", tokens),
                         bytes=check_nonneg_int("migration.bytes", bytes),
                         seconds=check_float("migration.seconds", seconds, minimum=0.0),
                         ok=check_bool("migration.ok", ok), reason=check_str("migration.reason", reason))
    session.add(row)
    session.flush()
    return row


def record_scheduler_event(session: Session, run_id: int, *, step: int, time: float, policy: str, kind: str,
                           devices: Sequence[int], reason: str, iter: int | None = None,
                           action_type: str | None = None, outcome: str | None = None) -> SchedulerEvent:
    """Record a scheduler "decision" (a policy's choice) or "action" (what the reconciler applied).

    An action names its `action_type`; `outcome` says what applying it did.
    """
    get_run(session, run_id)
    kind = check_one_of("scheduler_event.kind", kind, SCHEDULER_KINDS)
    action_type = check_str("scheduler_event.action_type", action_type, max_len=64, optional=kind == "decision")
    row = SchedulerEvent(run_id=run_id, step=check_nonneg_int("scheduler_event.step", step),
                         iter=None if iter is None else check_nonneg_int("scheduler_event.iter", iter),
                         time=check_float("scheduler_event.time", time),
                         policy=check_str("scheduler_event.policy", policy, max_len=64), kind=kind,
                         action_type=action_type, devices=check_devices("scheduler_event.devices", devices),
                         reason=check_str("scheduler_event.reason", reason),
                         outcome=check_str("scheduler_event.outcome", outcome, optional=True))
    session.add(row)
    session.flush()
    return row


def record_fault(session: Session, run_id: int, *, step: int, time: float, kind: str, device_id: int, role: str,
                 reason: str, seconds: float, bytes: int = 0, groups: int = 0, tokens: int = 0) -> FaultEvent:
    """Record a fault: device `device_id` (serving `role`) `failed`, its work `recovered`, or it `rejoined`."""
    get_run(session, run_id)
    row = FaultEvent(run_id=run_id, step=check_nonneg_int("fault.step", step), time=check_float("fault.time", time),
                     kind=check_one_of("fault.kind", kind, FAULT_KINDS),
                     device_id=check_nonneg_int("fault.device_id", device_id),
                     role=check_str("fault.role", role, max_len=16), reason=check_str("fault.reason", reason),
                     seconds=check_float("fault.seconds", seconds, minimum=0.0),
                     bytes=check_nonneg_int("fault.bytes", bytes), groups=check_nonneg_int("fault.groups", groups),
                     tokens=check_nonneg_int("fault.tokens", tokens))
    session.add(row)
    session.flush()
    return row


def list_faults(session: Session, run_id: int) -> list[FaultEvent]:
    return list(session.scalars(select(FaultEvent).where(FaultEvent.run_id == run_id).order_by(FaultEvent.id)))


def list_reshards(session: Session, run_id: int) -> list[ReshardEvent]:
    return list(session.scalars(select(ReshardEvent).where(ReshardEvent.run_id == run_id).order_by(ReshardEvent.id)))


def list_migrations(session: Session, run_id: int) -> list[MigrationEvent]:
    return list(session.scalars(
        select(MigrationEvent).where(MigrationEvent.run_id == run_id).order_by(MigrationEvent.id)))


def list_scheduler_events(session: Session, run_id: int, *, kind: str | None = None) -> list[SchedulerEvent]:
    """A run's scheduler events in recorded order; `kind` keeps only decisions or only actions."""
    query = select(SchedulerEvent).where(SchedulerEvent.run_id == run_id)
    if kind is not None:
        query = query.where(SchedulerEvent.kind == check_one_of("kind", kind, SCHEDULER_KINDS))
    return list(session.scalars(query.order_by(SchedulerEvent.id)))
