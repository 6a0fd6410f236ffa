"""tidal.db: the platform database (SQLAlchemy 2 + Alembic; SQLite by default, PostgreSQL by URL).

Layout, one idea per file:
- `models`      the tables, as typed ORM models;
- `session`     engines (SQLite: WAL, BEGIN IMMEDIATE, busy timeout) and `session_scope`;
- `migrate`     Alembic run from code: `upgrade(url)`, `open_database(url)`, `schema_diff`;
- `checks`      input checks whose errors name the field, the value and the fix;
- `repository`  small verbs that take the caller's session (`add_run`, `record_reshard`, `list_steps`, ...).

Contracts: the schema comes only from the migrations in `migrations/` (never `create_all`); repository
functions flush but never commit (the caller owns the transaction); nothing here imports the engine,
workers or orchestration code. See docs/database.md.
"""

from tidal.db.checks import InvalidRecord
from tidal.db.migrate import current_revision, downgrade, head_revision, open_database, schema_diff, upgrade
from tidal.db.models import DeviceTransition, MigrationEvent, ReshardEvent, Run, SchedulerEvent, Step
from tidal.db.repository import (add_run, add_step, attach_mlflow_run, finish_run, get_run, list_migrations,
                                 list_reshards, list_runs, list_scheduler_events, list_steps, list_transitions,
                                 record_migration, record_reshard, record_scheduler_event, record_transition,
                                 record_transitions)
from tidal.db.session import make_engine, session_scope

__all__ = [
    "InvalidRecord", "current_revision", "downgrade", "head_revision", "open_database", "schema_diff", "upgrade",
    "DeviceTransition", "MigrationEvent", "ReshardEvent", "Run", "SchedulerEvent", "Step",
    "add_run", "add_step", "attach_mlflow_run", "finish_run", "get_run", "list_migrations", "list_reshards",
    "list_runs", "list_scheduler_events", "list_steps", "list_transitions", "record_migration", "record_reshard",
    "record_scheduler_event", "record_transition", "record_transitions", "make_engine", "session_scope",
]
