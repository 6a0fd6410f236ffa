"""`python -m db`: migrate and inspect the platform database.

    python -m db upgrade  [--url URL] [--revision head]
    python -m db downgrade --revision REV [--url URL]
    python -m db current  [--url URL]        # revision the database is at, and the newest one
    python -m db check    [--url URL]        # exit 1 if the schema differs from the models
    python -m db revision -m "message" [--url URL]   # autogenerate a revision (database at head)

URL defaults to $TIDAL_DB_URL, else `tracking.db_url`'s default in tidal/core/config.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from db.migrate import current_revision, downgrade, head_revision, new_revision, schema_diff, upgrade
from db.session import make_engine
from tidal.core.config import TrackingConfig
from tidal.core.errors import TidalError


def main(argv: list[str] | None = None) -> int:
    default_url = os.environ.get("TIDAL_DB_URL") or TrackingConfig.model_fields["db_url"].default
    parser = argparse.ArgumentParser(prog="python -m db", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["upgrade", "downgrade", "current", "check", "revision"])
    parser.add_argument("--url", default=default_url, help=f"database URL (default {default_url})")
    parser.add_argument("--revision", default=None, help="target revision (upgrade: head; downgrade: required)")
    parser.add_argument("-m", "--message", default=None, help="message of a new revision")
    args = parser.parse_args(argv)
    try:
        if args.command == "upgrade":
            upgrade(args.url, args.revision or "head")
        elif args.command == "downgrade":
            if args.revision is None:
                parser.error("downgrade needs --revision (e.g. --revision base)")
            downgrade(args.url, args.revision)
        elif args.command == "revision":
            if not args.message:
                parser.error('revision needs -m "what changed"')
            new_revision(args.url, args.message)
        engine = make_engine(args.url)
        try:
            if args.command == "check":
                diff = schema_diff(engine)
                for d in diff:
                    print(d)
                print("schema matches the models" if not diff else f"{len(diff)} difference(s)")
                return 1 if diff else 0
            print(f"current: {current_revision(engine)}  head: {head_revision()}")
        finally:
            engine.dispose()
    except TidalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
