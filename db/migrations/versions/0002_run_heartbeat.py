"""Runs have a heartbeat, and a run whose driver died is `lost`.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

`runs.heartbeat_at`: when the run's driver last said it is alive (every few seconds while it runs). A
`running` run whose heartbeat is long past is marked `lost` by the next command that opens or starts runs.
SQLite cannot alter a CHECK constraint in place: batch mode rebuilds the table (named constraints, see 0001).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = "status IN ('running', 'finished', 'failed', 'aborted')"
NEW = "status IN ('running', 'finished', 'failed', 'aborted', 'lost')"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
        batch.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch.create_check_constraint("status", NEW)


def downgrade() -> None:
    op.execute("UPDATE runs SET status = 'failed' WHERE status = 'lost'")
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(op.f("ck_runs_status"), type_="check")
        batch.create_check_constraint("status", OLD)
        batch.drop_column("heartbeat_at")
