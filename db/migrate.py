"""Schema versions: Alembic migrations run from code, with no alembic.ini.

The schema is made and changed only by the revisions in `db/migrations/versions/` (installed as package data
of `db`), on SQLite and PostgreSQL alike. Applications open the database with `open_database(url)`,
which upgrades to head first; `create_all` is never used, so a database is always at a known revision.

    engine = open_database("sqlite:///runs/tidal.db")     # upgrade(url) then make_engine(url)
    python -m db upgrade --url postgresql+psycopg://tidal:pw@127.0.0.1:55432/tidal
    python -m db revision -m "add steps.kl" --url sqlite:///dev.db   # autogenerate a new revision

Choices:
- The version table is `tidal_schema_version`, not Alembic's default `alembic_version`, and autogenerate
  looks only at our tables (`include_name`): MLflow keeps its own Alembic history and tables, and the two
  may share one PostgreSQL database.
- Concurrent `upgrade()` calls are safe: the whole upgrade is one transaction that holds SQLite's write lock
  (BEGIN IMMEDIATE) or a PostgreSQL advisory lock, so later callers find the schema already at head. Within
  one process, threads also take turns on a lock: Alembic keeps its migration context in module globals.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine
from sqlalchemy.engine import URL

from db.models import Base
from db.session import make_engine, parse_url

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "tidal_schema_version"
#: key of the PostgreSQL advisory lock that serialises concurrent upgrades ("tidal" in ASCII).
PG_LOCK_KEY = 0x746964616C


def include_name(name: str | None, type_: str, parent_names: dict[str, Any]) -> bool:
    """Autogenerate and `schema_diff` consider only our tables (others may share the database)."""
    return type_ != "table" or name in Base.metadata.tables


def alembic_config(url: str | URL) -> Config:
    """An Alembic config pointing at the packaged migrations directory and at `url`."""
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(f"Alembic migrations not found at {MIGRATIONS_DIR}; reinstall tidal "
                                "(they ship as package data of db)")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # configparser treats % as interpolation; URL-escaped passwords contain it.
    cfg.set_main_option("sqlalchemy.url", parse_url(url).render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


#: Alembic's `context` and `op` are module-level proxies, one per process: commands must not overlap in threads.
_ALEMBIC_LOCK = threading.Lock()


def _run(url: str | URL, fn: Any, *args: Any, **kwargs: Any) -> None:
    """Run an Alembic command on one connection of our own engine, inside one transaction."""
    cfg = alembic_config(url)
    engine = make_engine(url)
    try:
        with _ALEMBIC_LOCK, engine.begin() as connection:
            cfg.attributes["connection"] = connection
            fn(cfg, *args, **kwargs)
    finally:
        engine.dispose()


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Bring the database at `url` to `revision` (default: the newest); a no-op when it is already there."""
    _run(url, command.upgrade, revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Step the database back to `revision` ("base" drops every table)."""
    _run(url, command.downgrade, revision)


def new_revision(url: str | URL, message: str) -> None:
    """Autogenerate a revision from the difference between the models and the database at `url` (at head)."""
    _run(url, command.revision, message=message, autogenerate=True)


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None, f"no revisions in {MIGRATIONS_DIR / 'versions'}"
    return head


def _context(connection: Any) -> MigrationContext:
    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE,
                                                        "include_name": include_name, "compare_type": True})


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for a database never migrated."""
    with engine.connect() as connection:
        return _context(connection).get_current_revision()


def schema_diff(engine: Engine) -> list[Any]:
    """Differences between the database's schema and the models (Alembic's `compare_metadata`); [] if none."""
    with engine.connect() as connection:
        return compare_metadata(_context(connection), Base.metadata)


def open_database(url: str | URL, **engine_kwargs: Any) -> Engine:
    """The one way applications open the platform database: migrate to head, then return an engine."""
    upgrade(url)
    return make_engine(url, **engine_kwargs)
