"""Alembic environment for the platform database; run through `db.migrate`, no alembic.ini needed.

`db.migrate` hands over an open connection made by `db.session.make_engine` (so SQLite gets
WAL and BEGIN IMMEDIATE). All pending revisions run in one transaction:
- SQLite: BEGIN IMMEDIATE holds the write lock, so concurrent `upgrade()` calls from several processes
  queue and the later ones find the schema at head;
- PostgreSQL: a transaction-scoped advisory lock does the same (DDL is transactional there too).
Autogenerate renders batch operations so new revisions also run on SQLite.
"""

from __future__ import annotations

from typing import Any, cast

from alembic import context
from sqlalchemy import text

from db.migrate import PG_LOCK_KEY, VERSION_TABLE, include_name
from db.models import Base
from db.session import make_engine

config = context.config
OPTIONS: dict[str, Any] = dict(target_metadata=Base.metadata, version_table=VERSION_TABLE, render_as_batch=True,
               compare_type=True, include_name=include_name)


def run_offline() -> None:
    """`--sql` mode: print the DDL instead of running it."""
    context.configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True,
                      dialect_opts={"paramstyle": "named"}, **OPTIONS)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:  # the alembic CLI pointed at this directory: make our own engine
        engine = make_engine(cast(str, config.get_main_option("sqlalchemy.url")))  # the CLI's -x / ini url
        with engine.connect() as connection:
            _migrate(connection)
        engine.dispose()
    else:
        _migrate(connection)


def _migrate(connection) -> None:
    context.configure(connection=connection, **OPTIONS)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_LOCK_KEY})
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
