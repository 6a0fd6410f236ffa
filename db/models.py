"""The platform database's tables, as typed SQLAlchemy 2 ORM models.

One row per fact, each tied to its run (deleting a run deletes its rows)::

    runs ─┬─< steps                one per training step: reward, eval accuracy, where the time went
          ├─< device_transitions   device ownership history (tidal.core.devices.Owner strings)
          ├─< reshard_events       actor layout changes: from/to layout, bytes, seconds, committed or rolled back
          ├─< migration_events     rollout request moves between instances (kv | reprefill)
          ├─< scheduler_events     every scheduler decision and every action it took, with the reason
          └─< fault_events         a device lost (failed), its work done again (recovered), back in the pool
                                   (rejoined): seconds, bytes, groups, tokens

Design choices:
- Enumerated strings (run status, owners, migration mode, event kind) are VARCHAR plus a named CHECK
  constraint, not native enums: identical on SQLite and PostgreSQL, no database types to migrate.
- Event times are seconds on the recording component's injected clock (floats, like
  `tidal.core.devices.Transition.time`); run start/end are timezone-aware UTC datetimes.
- JSON columns hold small structured values (config, layouts, device lists, per-phase seconds).
- Constraint names come from one naming convention, so Alembic migrations name them the same on every
  backend (SQLite batch mode needs named constraints to rebuild tables).

The schema is created by the Alembic migrations in `db/migrations/`, never by `create_all`; a test checks
that the migrations produce exactly these models.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from tidal.core.devices import Owner

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RUN_STATUSES = ("running", "finished", "failed", "aborted", "lost")   # lost: its driver died
OWNERS = tuple(o.value for o in Owner)
MIGRATION_MODES = ("kv", "reprefill")
SCHEDULER_KINDS = ("decision", "action")
FAULT_KINDS = ("failed", "recovered", "rejoined")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC datetime on both backends (SQLite stores no zone; we put UTC back on read)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"datetime {value!r} has no timezone; pass an aware datetime, e.g. datetime.now(UTC)")
        return value.astimezone(dt.UTC)

    def process_result_value(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _run_fk() -> Mapped[int]:
    return mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)


class Run(Base):
    """One training run: its resolved config, lifecycle and where its outputs went."""

    __tablename__ = "runs"
    __table_args__ = (CheckConstraint(_one_of("status", RUN_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), nullable=False)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, nullable=False)
    ended_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    #: when the driver last said it is alive; a running run whose heartbeat is long past is `lost`
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    #: the Prefect flow run that drove it (`rl-training`); None for a run `tidal train` drove without `--flow`
    prefect_flow_run_id: Mapped[str | None] = mapped_column(String(64), index=True)
    output_dir: Mapped[str | None] = mapped_column(Text)


class Step(Base):
    """One RL step of a run; a step is recorded once."""

    __tablename__ = "steps"
    __table_args__ = (
        CheckConstraint("device_idle_fraction >= 0 AND device_idle_fraction <= 1", name="idle_fraction"),
    )

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    reward: Mapped[float | None] = mapped_column(Float)
    eval_accuracy: Mapped[float | None] = mapped_column(Float)
    step_seconds: Mapped[float] = mapped_column(Float, nullable=False)
    #: phase name -> seconds, e.g. {"generate": 1.2, "train": 3.4}.
    phase_seconds: Mapped[dict[str, float]] = mapped_column(JSON, nullable=False)
    device_idle_fraction: Mapped[float | None] = mapped_column(Float)


class DeviceTransition(Base):
    """One ownership move of one device (a row of `tidal.core.devices.DeviceLedger.history`)."""

    __tablename__ = "device_transitions"
    __table_args__ = (
        CheckConstraint(_one_of("from_owner", OWNERS), name="from_owner"),
        CheckConstraint(_one_of("to_owner", OWNERS), name="to_owner"),
        Index(None, "run_id", "device_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = _run_fk()
    device_id: Mapped[int] = mapped_column(Integer, nullable=False)
    from_owner: Mapped[str] = mapped_column(String(16), nullable=False)
    to_owner: Mapped[str] = mapped_column(String(16), nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    time: Mapped[float] = mapped_column(Float, nullable=False)


class ReshardEvent(Base):
    """One actor reshard: from one layout to another, committed (`ok`) or rolled back (reason says why)."""

    __tablename__ = "reshard_events"
    __table_args__ = (Index(None, "run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = _run_fk()
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    iter: Mapped[int] = mapped_column(Integer, nullable=False)
    #: {"tp": int, "dp": int, "devices": [int, ...]} (the actor layout).
    from_layout: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    to_layout: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    #: every device that took part (sent or received bytes).
    devices: Mapped[list[int]] = mapped_column(JSON, nullable=False)
    bytes_moved: Mapped[int] = mapped_column(BigInteger, nullable=False)
    seconds: Mapped[float] = mapped_column(Float, nullable=False)
    ok: Mapped[bool] = mapped_column(Boolean, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)


class MigrationEvent(Base):
    """One rollout request (of a group) moved between generation instances, with its KV cache or re-prefilled."""

    __tablename__ = "migration_events"
    __table_args__ = (
        CheckConstraint(_one_of("mode", MIGRATION_MODES), name="mode"),
        Index(None, "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = _run_fk()
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    request_id: Mapped[str] = mapped_column(String(64), nullable=False)
    group_id: Mapped[str] = mapped_column(String(64), nullable=False)
    source_instance: Mapped[str] = mapped_column(String(64), nullable=False)
    target_instance: Mapped[str] = mapped_column(String(64), nullable=False)
    mode: Mapped[str] = mapped_column(String(16), nullable=False)
    #: tokens carried over (KV entries moved, or tokens re-prefilled).
    tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    seconds: Mapped[float] = mapped_column(Float, nullable=False)
    ok: Mapped[bool] = mapped_column(Boolean, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)


class SchedulerEvent(Base):
    """A scheduler decision (what a policy chose, and why) or an action the reconciler applied (and its outcome)."""

    __tablename__ = "scheduler_events"
    __table_args__ = (
        CheckConstraint(_one_of("kind", SCHEDULER_KINDS), name="kind"),
        Index(None, "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = _run_fk()
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    iter: Mapped[int | None] = mapped_column(Integer)
    time: Mapped[float] = mapped_column(Float, nullable=False)
    policy: Mapped[str] = mapped_column(String(64), nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)
    action_type: Mapped[str | None] = mapped_column(String(64))
    devices: Mapped[list[int]] = mapped_column(JSON, nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    #: what applying it did ("applied", "refused: ..."); None for a decision not (yet) acted on.
    outcome: Mapped[str | None] = mapped_column(Text)


class FaultEvent(Base):
    """A device lost (`failed`: its work handed to the survivors), that work done again (`recovered`), or the
    device back in the free pool (`rejoined`: a replacement worker answers). tidal.pipeline.faults and .rejoin."""

    __tablename__ = "fault_events"
    __table_args__ = (
        CheckConstraint(_one_of("kind", FAULT_KINDS), name="kind"),
        Index(None, "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = _run_fk()
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    time: Mapped[float] = mapped_column(Float, nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)
    device_id: Mapped[int] = mapped_column(Integer, nullable=False)
    #: the component the device served when it failed (rollout, inference).
    role: Mapped[str] = mapped_column(String(16), nullable=False)
    reason: Mapped[str] = mapped_column(Text, nullable=False)
    #: failed: detection -> work handed over; recovered: failure -> work done again; rejoined: failure -> free.
    seconds: Mapped[float] = mapped_column(Float, nullable=False)
    #: failed: the work handed to survivors; rejoined: what was sent to the replacement (its weights come later).
    bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    #: groups redone (failed, recovered).
    groups: Mapped[int] = mapped_column(Integer, nullable=False)
    #: response tokens generated or scored again (recovered).
    tokens: Mapped[int] = mapped_column(Integer, nullable=False)
