"""db: the platform database (SQLAlchemy 2 + Alembic; SQLite by default, PostgreSQL by URL).

Records runs, steps, device ownership moves, reshards, request migrations and scheduler events, with one schema
history for both databases. Guide: docs/database.md.

Entry points (re-exported here), one idea per module:
- `migrate`     Alembic run from code, no alembic.ini: `open_database(url)` (upgrade to head, then an engine),
                `upgrade`, `downgrade`, `current_revision`, `head_revision`, `schema_diff`;
- `session`     `make_engine(url)` (SQLite: WAL, BEGIN IMMEDIATE, busy timeout) and
                `session_scope(engine)` (one transaction: commit on exit, rollback on error);
- `models`      the tables as typed ORM models: `Run`, `Step`, `DeviceTransition`, `ReshardEvent`,
                `MigrationEvent`, `SchedulerEvent`;
- `repository`  verbs that take the caller's session: `add_run`, `add_step`, `finish_run`, `heartbeat`,
                `mark_lost`, `record_*`, `list_*`;
- `checks`      input checks; `InvalidRecord` names the field, the value and the fix;
- `__main__`    `python -m db upgrade|downgrade|current|check|revision`; `migrations/` holds the revisions
                (package data).

Imports: SQLAlchemy and Alembic; from Tidal only itself, `tidal.core.devices` (owner names), `tidal.core.errors`
and, for the CLI's default URL, `tidal.core.config`. Never the engine, workers, scheduler, flows, tasks, torch, Prefect,
MLflow, Ray or Optuna (tests/test_db.py).

Invariants (tests/test_db.py):
- the schema comes only from the migrations (never `create_all`) and equals the models (`schema_diff == []`);
  migrations apply, downgrade and re-apply on SQLite and PostgreSQL; concurrent upgrades migrate once;
- repository functions check their inputs and flush, never commit: the caller owns the transaction;
- concurrent writers (threads; for SQLite also processes) lose no row;
- deleting a run deletes its rows;
- the version table is `tidal_schema_version`, not Alembic's default, so MLflow's tables can share a database.
"""

from db.checks import InvalidRecord
from db.migrate import current_revision, downgrade, head_revision, open_database, schema_diff, upgrade
from db.models import DeviceTransition, FaultEvent, MigrationEvent, ReshardEvent, Run, SchedulerEvent, Step
from db.repository import (
    add_run,
    add_step,
    attach_mlflow_run,
    finish_run,
    forget_steps_from,
    get_run,
    heartbeat,
    list_faults,
    list_migrations,
    list_reshards,
    list_runs,
    list_scheduler_events,
    list_steps,
    list_transitions,
    mark_lost,
    record_fault,
    record_migration,
    record_reshard,
    record_scheduler_event,
    record_transition,
    record_transitions,
)
from db.session import make_engine, session_scope

__all__ = [
    "InvalidRecord", "current_revision", "downgrade", "head_revision", "open_database", "schema_diff", "upgrade",
    "DeviceTransition", "FaultEvent", "MigrationEvent", "ReshardEvent", "Run", "SchedulerEvent", "Step",
    "add_run", "add_step", "attach_mlflow_run", "finish_run", "get_run", "heartbeat", "list_migrations",
    "list_reshards", "mark_lost",
    "list_runs", "list_scheduler_events", "list_steps", "list_transitions", "record_migration", "record_reshard",
    "record_scheduler_event", "record_transition", "record_transitions", "make_engine", "session_scope",
    "list_faults", "record_fault", "forget_steps_from",
]
