"""Engines and sessions for the platform database: SQLite by default, PostgreSQL by URL.

    engine = make_engine("sqlite:///runs/tidal.db")   # or "postgresql+psycopg://user:pw@127.0.0.1:5432/tidal"
    upgrade(engine.url)                                # db.migrate: the schema comes from migrations
    with session_scope(engine) as session:             # one transaction: commit on exit, rollback on error
        run = add_run(session, name="gsm8k", config={...})

The caller owns the transaction: repository functions only add and flush; `session_scope` commits.

SQLite under concurrent writers (threads and processes):
- WAL journal: readers never block the writer, the writer never blocks readers.
- Every transaction starts with `BEGIN IMMEDIATE`, taking the write lock up front. A deferred transaction
  that reads (e.g. "does this run exist?") and then writes can fail at once with "database is locked" when
  another writer committed in between: SQLite cannot upgrade its stale snapshot, and the busy handler is not
  consulted. Taking the lock first makes every writer simply queue on the busy timeout.
- `busy_timeout` (default 30 s) is how long a writer waits in that queue.
- Switching a fresh file to WAL needs an exclusive lock that the busy handler does not always cover when
  many processes open the file at once; that pragma is retried with bounded, jittered backoff.
- `foreign_keys=ON` so runs really own their rows.

    writer A: BEGIN IMMEDIATE ─ insert ─ COMMIT
    writer B:       BEGIN IMMEDIATE (waits on busy_timeout) ───────────────── insert ─ COMMIT
    other tool:  SELECT (sqlite3 CLI, a dashboard: a WAL snapshot, never waits)

  Sessions that only read queue like writers do (every transaction is milliseconds long at our rates);
  tools that read the file directly never wait.

PostgreSQL needs none of this; its engine pings pooled connections before use.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from tidal.core.errors import ConfigError

FIELD = "tracking.db_url"
URL_FIX = 'use "sqlite:///path/to/tidal.db" or "postgresql+psycopg://user:password@127.0.0.1:5432/dbname"'


def parse_url(url: str | URL) -> URL:
    """Validate a database URL; `postgresql://` means the psycopg (3) driver, the one Tidal installs."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(FIELD, str(url), "is not a database URL", URL_FIX) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername not in ("sqlite", "sqlite+pysqlite", "postgresql+psycopg"):
        raise ConfigError(FIELD, parsed.render_as_string(hide_password=True),
                          f"uses driver {parsed.drivername!r}, which Tidal does not support", URL_FIX)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        parent = Path(parsed.database).expanduser().resolve().parent
        if not parent.is_dir():
            raise ConfigError(FIELD, str(parsed), f"names a file in {parent}, which does not exist",
                              f"create the directory ({parent}) or point the URL at an existing one")
    return parsed


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str | URL, *, busy_timeout_s: float = 30.0, echo: bool = False) -> Engine:
    """An engine for `url` with the concurrency settings described in the module docstring."""
    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, echo=echo, pool_pre_ping=True)
    in_memory = parsed.database in (None, "", ":memory:")
    # One shared connection for an in-memory database: each new connection would see an empty one.
    extra: dict[str, Any] = {"poolclass": StaticPool} if in_memory else {}
    engine = create_engine(parsed, echo=echo, connect_args={"timeout": busy_timeout_s, "check_same_thread": False},
                           **extra)
    _configure_sqlite(engine, busy_timeout_s, wal=not in_memory)
    return engine


def _configure_sqlite(engine: Engine, busy_timeout_s: float, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        # Stop pysqlite from issuing its own (deferred) BEGIN; `_on_begin` issues BEGIN IMMEDIATE instead.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if wal:
                retry_locked(lambda: cursor.execute("PRAGMA journal_mode = WAL"), deadline_s=busy_timeout_s)
                # Durable at each checkpoint rather than at each commit: safe with WAL, much faster.
                cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def is_locked_error(exc: BaseException) -> bool:
    """True for SQLite's transient lock errors (raw or wrapped by SQLAlchemy)."""
    orig = getattr(exc, "orig", exc)
    return isinstance(orig, sqlite3.OperationalError) and ("locked" in str(orig) or "busy" in str(orig))


def retry_locked(fn: Any, *, deadline_s: float = 30.0, first_wait_s: float = 0.005, max_wait_s: float = 0.5) -> Any:
    """Call `fn()` until it does not raise a lock error; jittered exponential backoff, bounded by `deadline_s`."""
    end = time.monotonic() + deadline_s
    wait = first_wait_s
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - only lock errors are retried; everything else re-raises
            if not is_locked_error(exc) or time.monotonic() + wait > end:
                raise
        time.sleep(wait * (0.5 + random.random()))
        wait = min(wait * 2, max_wait_s)


@contextlib.contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One unit of work: commit when the block ends, roll back (and re-raise) if it raises.

    Objects stay readable after the commit (`expire_on_commit=False`), so a caller can return them.
    """
    session = Session(engine, expire_on_commit=False)
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
